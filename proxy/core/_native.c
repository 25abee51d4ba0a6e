/*
 * proxy.core._native: the per-request work of a token-id completion, outside the interpreter.
 *
 * Five functions, each with a pure-Python reference that stays the specification
 * (proxy/core/extract.py + proxy/hotpath.py's parse, proxy/core/hashing.py's _chain and
 * FastHasher.extend, proxy/core/prefix_index.py's record and reach) and that
 * tests compare against on random and adversarial input (tests/unit/test_native.py):
 *
 *   split_prompt(body) -> (array('I') ids, rest) | None
 *       Finds the top-level "prompt" of a JSON object and, when it is a non-empty array of
 *       non-negative integers <= 2**32 - 1, packs it straight from the bytes (the 512 Python
 *       ints orjson would create and the array packing them are never made) and returns the
 *       body with that array replaced by 0 (`rest`), which the caller parses with orjson: every
 *       other field keeps the reference's parser and its exact validation and errors. Anything
 *       else returns None and the caller runs the reference path on the original body: text
 *       prompts, batches, floats, exponents, negatives, leading zeros, huge ids, a second
 *       "prompt" key, any top-level key with an escape, and malformed JSON.
 *
 *   chain(data, step, seed) -> list[int]
 *       Chained XXH3-64 block keys: for each full `step`-byte block, h = XXH3_64(block, seed=h),
 *       starting from `seed`; exactly FastHasher's _chain.
 *
 *   record_chain(young, keys, known, holder)
 *       PrefixIndex.record's dict writes for one chain (prefix_index.py's _updated and links).
 *
 *   prefix_walk(values, count, replicas) -> ({replica: reach}, common) | None
 *       The common-prefix walk over looked-up index values (reach.py's prefix_reach over
 *       PrefixIndex.held and .branching), in one pass without the intermediate lists.
 *
 *   extend_chain(prompt, start, completion, block_size, parent) -> list[int] | None
 *       A chain continued through a packed prompt's tail and a completion's ids
 *       (FastHasher.extend over the concatenated ids), packed without a Python list.
 *
 * The body is untrusted: every read is bounds-checked against its length, nothing recurses
 * (nested values are skipped with a depth counter), and the scan is one forward pass.
 *
 * Why replacing the array by 0 cannot make an invalid body valid: the scanner finds string
 * boundaries exactly as a JSON lexer does (every quote outside a string opens one, a backslash
 * skips the next byte), so the array it replaces lies outside strings in orjson's view too, and
 * it sits where the object grammar puts a value ("key" : VALUE followed by , or }). If the body
 * with 0 there is valid JSON, the 0 is a value, and the original with a valid integer array in
 * its place was valid too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

/* array.array, looked up once at import (the ids are returned as array('I'), what the rest of
 * the proxy already takes for packed ids). */
static PyObject *array_type = NULL;

#define MAX_TOKEN_ID 0xFFFFFFFFull

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static Py_ssize_t skip_ws(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) {
    while (i < n && is_ws(s[i])) i++;
    return i;
}

/* s[i] is the opening quote; returns the index after the closing quote, or -1. Sets
 * *escaped when the string holds a backslash. */
static Py_ssize_t skip_string(const unsigned char *s, Py_ssize_t i, Py_ssize_t n, int *escaped) {
    i++;
    while (i < n) {
        unsigned char c = s[i];
        if (c == '"') return i + 1;
        if (c == '\\') {
            if (escaped) *escaped = 1;
            i += 2;
            continue;
        }
        i++;
    }
    return -1;
}

/* Skips one value starting at s[i] (not whitespace); returns the index after it, or -1.
 * Containers are skipped by depth (bracket kinds are not matched: orjson validates the body
 * afterwards, this only has to agree with a JSON lexer on where strings are). Scalars are runs
 * of the characters numbers and literals are made of. */
static Py_ssize_t skip_value(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) {
    if (i >= n) return -1;
    unsigned char c = s[i];
    if (c == '"') return skip_string(s, i, n, NULL);
    if (c == '[' || c == '{') {
        Py_ssize_t depth = 0;
        while (i < n) {
            c = s[i];
            if (c == '"') {
                i = skip_string(s, i, n, NULL);
                if (i < 0) return -1;
                continue;
            }
            if (c == '[' || c == '{') depth++;
            else if (c == ']' || c == '}') {
                depth--;
                if (depth == 0) return i + 1;
            }
            i++;
        }
        return -1;
    }
    Py_ssize_t start = i;
    while (i < n) {
        c = s[i];
        if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
            c == '.' || c == '+' || c == '-')
            i++;
        else
            break;
    }
    return i > start ? i : -1;
}

typedef struct {
    uint32_t *ids;
    Py_ssize_t len;
    Py_ssize_t cap;
} IdBuffer;

static int push_id(IdBuffer *buf, uint32_t id) {
    if (buf->len == buf->cap) {
        Py_ssize_t cap = buf->cap ? buf->cap * 2 : 1024;
        uint32_t *grown = PyMem_Realloc(buf->ids, (size_t)cap * sizeof(uint32_t));
        if (grown == NULL) return -1;
        buf->ids = grown;
        buf->cap = cap;
    }
    buf->ids[buf->len++] = id;
    return 0;
}

/* s[i] is '['. Parses a strict, non-empty array of integers in [0, MAX_TOKEN_ID] into buf;
 * returns the index after ']', -1 when the array is anything else, -2 on memory error. */
static Py_ssize_t scan_ids(const unsigned char *s, Py_ssize_t i, Py_ssize_t n, IdBuffer *buf) {
    i = skip_ws(s, i + 1, n);
    for (;;) {
        if (i >= n || s[i] < '0' || s[i] > '9') return -1; /* also: empty array, '-', nested */
        uint64_t value = 0;
        Py_ssize_t start = i;
        if (s[i] == '0') {
            i++; /* JSON has no leading zeros: "01" falls to the reference (an error there) */
        } else {
            /* 10 digits hold every id up to 4,294,967,295; an 11th is out of range anyway */
            while (i < n && s[i] >= '0' && s[i] <= '9' && i - start < 11) {
                value = value * 10 + (uint64_t)(s[i] - '0');
                i++;
            }
        }
        if (value > MAX_TOKEN_ID) return -1;
        if (i < n && ((s[i] >= '0' && s[i] <= '9') || s[i] == '.' || s[i] == 'e' || s[i] == 'E'))
            return -1; /* a fraction, an exponent, a leading zero or too many digits */
        if (push_id(buf, (uint32_t)value) < 0) return -2;
        i = skip_ws(s, i, n);
        if (i >= n) return -1;
        if (s[i] == ']') return i + 1;
        if (s[i] != ',') return -1;
        i = skip_ws(s, i + 1, n);
    }
}

static PyObject *split_prompt(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *s = view.buf;
    Py_ssize_t n = view.len;
    IdBuffer ids = {NULL, 0, 0};
    Py_ssize_t prompt_start = -1, prompt_end = -1;
    PyObject *result = NULL;

    Py_ssize_t i = skip_ws(s, 0, n);
    if (i >= n || s[i] != '{') goto fallback;
    i = skip_ws(s, i + 1, n);
    if (i < n && s[i] == '}') goto fallback; /* no prompt: the reference says so */
    for (;;) {
        if (i >= n || s[i] != '"') goto fallback;
        int escaped = 0;
        Py_ssize_t key_start = i + 1;
        Py_ssize_t after_key = skip_string(s, i, n, &escaped);
        /* an escaped key could spell "prompt" in disguise: let the reference decide */
        if (after_key < 0 || escaped) goto fallback;
        int is_prompt = (after_key - 1 - key_start == 6) && memcmp(s + key_start, "prompt", 6) == 0;
        i = skip_ws(s, after_key, n);
        if (i >= n || s[i] != ':') goto fallback;
        i = skip_ws(s, i + 1, n);
        if (is_prompt) {
            if (prompt_start >= 0 || i >= n || s[i] != '[') goto fallback;
            Py_ssize_t end = scan_ids(s, i, n, &ids);
            if (end == -2) {
                PyErr_NoMemory();
                goto done;
            }
            if (end < 0) goto fallback;
            prompt_start = i;
            prompt_end = end;
            i = end;
        } else {
            i = skip_value(s, i, n);
            if (i < 0) goto fallback;
        }
        i = skip_ws(s, i, n);
        if (i >= n) goto fallback;
        if (s[i] == '}') break;
        if (s[i] != ',') goto fallback;
        i = skip_ws(s, i + 1, n);
    }
    if (skip_ws(s, i + 1, n) != n || prompt_start < 0) goto fallback;

    {
        Py_ssize_t rest_len = n - (prompt_end - prompt_start) + 1;
        PyObject *rest = PyBytes_FromStringAndSize(NULL, rest_len);
        if (rest == NULL) goto done;
        char *out = PyBytes_AS_STRING(rest);
        memcpy(out, s, (size_t)prompt_start);
        out[prompt_start] = '0';
        memcpy(out + prompt_start + 1, s + prompt_end, (size_t)(n - prompt_end));
        PyObject *packed = PyBytes_FromStringAndSize((const char *)ids.ids,
                                                     ids.len * (Py_ssize_t)sizeof(uint32_t));
        PyObject *array = packed ? PyObject_CallFunction(array_type, "sO", "I", packed) : NULL;
        Py_XDECREF(packed);
        if (array == NULL) {
            Py_DECREF(rest);
            goto done;
        }
        result = PyTuple_Pack(2, array, rest);
        Py_DECREF(array);
        Py_DECREF(rest);
        goto done;
    }

fallback:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ids.ids);
    PyBuffer_Release(&view);
    return result;
}

/* The keys of `blocks` consecutive `step`-byte blocks of `data`, chained: each block's key is
 * its XXH3-64 seeded with the previous key, the first seeded with `seed`. A new list. */
static PyObject *chained_keys(const char *data, Py_ssize_t blocks, size_t step,
                              unsigned long long seed) {
    PyObject *keys = PyList_New(blocks);
    if (keys == NULL) return NULL;
    XXH64_hash_t h = (XXH64_hash_t)seed;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        h = XXH3_64bits_withSeed(data + (size_t)b * step, step, h);
        PyObject *key = PyLong_FromUnsignedLongLong(h);
        if (key == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, b, key);
    }
    return keys;
}

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain(data, step, seed) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t step = PyLong_AsSsize_t(args[1]);
    if (step == -1 && PyErr_Occurred()) return NULL;
    if (step < 1) {
        PyErr_SetString(PyExc_ValueError, "step must be >= 1");
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *keys = chained_keys(view.buf, view.len / step, (size_t)step, seed);
    PyBuffer_Release(&view);
    return keys;
}

/* PrefixIndex.record's writes for one chain (proxy/core/prefix_index.py, whose module doc
 * defines the packed value): keys[i] gets known[i] (what lookup found, i < len(known)) with
 * `holder` added and its link to keys[i + 1] (first child's 16-bit fingerprint, or branching
 * when another follows), then fresh values for the blocks past the first unknown one, the last
 * marked as a request's end. Exactly _updated + the links of the reference, written into the
 * young generation `young` in the same order. The caller guarantees every value fits 64 bits
 * (19 flag/fingerprint bits + max_replicas <= 64); a key or value that does not raises. */
#define HAS_CHILD 1ull
#define BRANCHING 2ull
#define REQUEST_END 4ull
#define FP_SHIFT 3
#define FP_MASK 0xFFFFull

static int set_value(PyObject *young, PyObject *key, unsigned long long value) {
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    if (v == NULL) return -1;
    int rc = PyDict_SetItem(young, key, v);
    Py_DECREF(v);
    return rc;
}

static PyObject *record_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "record_chain(young: dict, keys, known, holder)");
        return NULL;
    }
    PyObject *young = args[0];
    unsigned long long holder = PyLong_AsUnsignedLongLong(args[3]);
    if (holder == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *keys = PySequence_Fast(args[1], "keys must be a sequence");
    if (keys == NULL) return NULL;
    PyObject *known = PySequence_Fast(args[2], "known must be a sequence");
    if (known == NULL) {
        Py_DECREF(keys);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), k = PySequence_Fast_GET_SIZE(known);
    PyObject **key_items = PySequence_Fast_ITEMS(keys), **known_items = PySequence_Fast_ITEMS(known);
    PyObject *result = NULL;
    if (k > n) {
        PyErr_SetString(PyExc_ValueError, "more known values than keys");
        goto done;
    }
    unsigned long long next_fp = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int last = (i == n - 1);
        if (!last) {
            unsigned long long next = PyLong_AsUnsignedLongLong(key_items[i + 1]);
            if (next == (unsigned long long)-1 && PyErr_Occurred()) goto done;
            next_fp = next & FP_MASK;
        }
        unsigned long long value;
        if (i < k) {
            value = PyLong_AsUnsignedLongLong(known_items[i]);
            if (value == (unsigned long long)-1 && PyErr_Occurred()) goto done;
            value |= holder;
            if (last)
                value |= REQUEST_END;
            else if (!(value & HAS_CHILD))
                value |= HAS_CHILD | (next_fp << FP_SHIFT);
            else if (((value >> FP_SHIFT) & FP_MASK) != next_fp)
                value |= BRANCHING;
        } else {
            value = last ? (holder | REQUEST_END) : (holder | HAS_CHILD | (next_fp << FP_SHIFT));
        }
        if (set_value(young, key_items[i], value) < 0) goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(keys);
    Py_DECREF(known);
    return result;
}

/* The common-prefix walk of one looked-up chain (proxy/core/reach.py's prefix_reach over
 * PrefixIndex.held and .branching, the reference): values are the packed index values of the
 * chain's leading blocks (prefix_index.py's layout, holders from bit HOLDERS_SHIFT), `count`
 * how many of them to read, `replicas` the eligible replica indices. Returns ({replica: reach},
 * common) exactly as the reference does, dict order included, or None where the reference must
 * decide: a replica index outside 0..63-HOLDERS_SHIFT, a value that does not fit 64 bits, or
 * anything that is not an int (the reference then raises or computes with Python ints). */
#define HOLDERS_SHIFT 19
#define MAX_WALK_REPLICAS (64 - HOLDERS_SHIFT)

static PyObject *prefix_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "prefix_walk(values, count, replicas)");
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    PyObject *values = PySequence_Fast(args[0], "values must be a sequence");
    if (values == NULL) return NULL;
    PyObject *replicas = PySequence_Fast(args[2], "replicas must be a sequence");
    if (replicas == NULL) {
        Py_DECREF(values);
        return NULL;
    }
    PyObject *result = NULL, *reach = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    if (count < n) n = count < 0 ? 0 : count;
    Py_ssize_t r_count = PySequence_Fast_GET_SIZE(replicas);
    PyObject **value_items = PySequence_Fast_ITEMS(values);
    PyObject **replica_items = PySequence_Fast_ITEMS(replicas);
    uint64_t eligible = 0;
    long indices[64];
    if (r_count > 64) goto fallback; /* more than the distinct indices that fit: reference */
    for (Py_ssize_t i = 0; i < r_count; i++) {
        if (!PyLong_CheckExact(replica_items[i])) goto fallback;
        long r = PyLong_AsLong(replica_items[i]);
        if (r == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
        if (r < 0 || r >= MAX_WALK_REPLICAS) goto fallback;
        indices[i] = r;
        eligible |= 1ull << r;
    }
    /* reach_of[r]: blocks held by r from block 0 on; n for those holding all of them */
    Py_ssize_t reach_of[MAX_WALK_REPLICAS];
    for (int r = 0; r < MAX_WALK_REPLICAS; r++) reach_of[r] = n;
    Py_ssize_t deepest_full = -1, deepest_branch = -1;
    uint64_t alive = eligible;
    for (Py_ssize_t d = 0; d < n; d++) {
        if (!PyLong_CheckExact(value_items[d])) goto fallback;
        unsigned long long v = PyLong_AsUnsignedLongLong(value_items[d]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
        uint64_t held = (v >> HOLDERS_SHIFT) & eligible;
        if (held == eligible) deepest_full = d;
        if ((v & (BRANCHING | REQUEST_END)) == BRANCHING) deepest_branch = d;
        uint64_t dropped = alive & ~held;
        while (dropped) {
            int r = __builtin_ctzll(dropped);
            reach_of[r] = d;
            dropped &= dropped - 1;
        }
        alive &= held;
    }
    Py_ssize_t common = deepest_full > deepest_branch ? deepest_full + 1 : deepest_branch + 1;
    reach = PyDict_New();
    if (reach == NULL) goto done;
    for (Py_ssize_t i = 0; i < r_count; i++) {
        PyObject *depth = PyLong_FromSsize_t(reach_of[indices[i]]);
        if (depth == NULL || PyDict_SetItem(reach, replica_items[i], depth) < 0) {
            Py_XDECREF(depth);
            goto done;
        }
        Py_DECREF(depth);
    }
    result = Py_BuildValue("(On)", reach, common);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(reach);
    Py_DECREF(values);
    Py_DECREF(replicas);
    return result;
}

/* A chain continued past a prompt's last full block (FastHasher.extend_tail, the reference:
 * FastHasher.extend over list(prompt[start:]) + list(completion)): the ids prompt[start:]
 * (prompt an array('I') or any buffer of native uint32) then the completion's ints, packed
 * as uint32 and chained from `parent` in blocks of `block_size` ids. Returns the keys of the
 * full blocks, or None where the reference must decide: a completion id that is not an int in
 * 0..2**32-1 (the reference then packs 64-bit ids, or raises), or a prompt buffer whose length
 * is not whole uint32s. */
static PyObject *extend_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "extend_chain(prompt, start, completion, block_size, parent)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[3]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size < 1 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1 and start >= 0");
        return NULL;
    }
    unsigned long long parent = PyLong_AsUnsignedLongLong(args[4]);
    if (parent == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *completion = PySequence_Fast(args[2], "completion must be a sequence");
    if (completion == NULL) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(completion);
        return NULL;
    }
    PyObject *result = NULL;
    uint32_t *ids = NULL;
    if (view.len % 4 != 0) goto fallback;
    Py_ssize_t prompt_len = view.len / 4;
    Py_ssize_t tail = start < prompt_len ? prompt_len - start : 0;
    Py_ssize_t generated = PySequence_Fast_GET_SIZE(completion);
    Py_ssize_t total = tail + generated;
    ids = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(uint32_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (tail) memcpy(ids, (const char *)view.buf + start * 4, (size_t)tail * 4);
    PyObject **items = PySequence_Fast_ITEMS(completion);
    for (Py_ssize_t i = 0; i < generated; i++) {
        if (!PyLong_CheckExact(items[i])) goto fallback;
        unsigned long long id = PyLong_AsUnsignedLongLong(items[i]);
        if (id == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
        if (id > MAX_TOKEN_ID) goto fallback;
        ids[tail + i] = (uint32_t)id;
    }
    result = chained_keys((const char *)ids, total / block_size, (size_t)block_size * 4, parent);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ids);
    PyBuffer_Release(&view);
    Py_DECREF(completion);
    return result;
}

static PyMethodDef methods[] = {
    {"split_prompt", split_prompt, METH_O,
     "split_prompt(body) -> (array('I') ids, body with the prompt replaced by 0) or None"},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(data, step, seed) -> chained XXH3-64 keys of data's full step-byte blocks"},
    {"record_chain", (PyCFunction)(void (*)(void))record_chain, METH_FASTCALL,
     "record_chain(young, keys, known, holder): PrefixIndex.record's writes for one chain"},
    {"prefix_walk", (PyCFunction)(void (*)(void))prefix_walk, METH_FASTCALL,
     "prefix_walk(values, count, replicas) -> ({replica: reach}, common) or None"},
    {"extend_chain", (PyCFunction)(void (*)(void))extend_chain, METH_FASTCALL,
     "extend_chain(prompt, start, completion, block_size, parent) -> keys or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "proxy.core._native",
    "Token-id prompt scanning and chained XXH3-64 block keys in C (see _native.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (sizeof(uint32_t) != 4) return NULL;
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) return NULL;
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (array_type == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "XXHASH_VERSION", "0.8.2") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* The packed index value's layout as this file defines it, in prefix_index.py's order:
     * PrefixIndex refuses the module when its own constants differ (no silent drift). */
    PyObject *layout = Py_BuildValue("(KKKiKi)", HAS_CHILD, BRANCHING, REQUEST_END, FP_SHIFT,
                                     FP_MASK, HOLDERS_SHIFT);
    if (layout == NULL || PyModule_AddObject(m, "INDEX_LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
