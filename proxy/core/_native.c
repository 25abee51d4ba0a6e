/*
 * proxy.core._native: the per-request work of a token-id completion, outside the interpreter.
 *
 * Seven functions, vLLM's exact digests and the views' seven loops (listed last), each with a
 * pure-Python reference that stays the specification
 * (proxy/core/extract.py + proxy/hotpath.py's parse, proxy/core/hashing.py's _chain and
 * FastHasher.extend, proxy/core/prefix_index.py's record and reach, proxy/core/router.py's
 * Router.route with proxy/core/policy.py's policies) and that tests compare against on random
 * and adversarial input (tests/unit/test_native.py, tests/unit/test_native_route.py):
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
 *   route_tokens(index, policy, kind, tokens, block_size, seed, loads, capacity, decision)
 *       Router.route for a token-id prompt in one call: the functions above plus the index's
 *       lookup and the cost / prefix policy's arithmetic (see its section below).
 *
 *   learn_tokens(index, tokens, completion, block_size, blocks, replica) -> True | None
 *       Router.record_completion for a token-id prompt in one call (extend_chain, lookup,
 *       record).
 *
 *   vllm_chain(algo, parent, tokens, start, stop, block_size, first_extra, extra)
 *       vLLM's exact block digests (hashing.py's VllmHasher.digests: pickle or CBOR, sha256 or
 *       xxh3-128), with their event keys; twin tests in tests/unit/test_vllm_chain_native.py.
 *
 *   view_store / view_remove / view_apply / view_hold / view_release / view_expect / view_prefix
 *       The KV-events views' per-key loops (proxy/core/kv_view.py's _store ... _prefix, twin
 *       tests in tests/unit/test_kv_view_native.py; see their section below).
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
#include <math.h>
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

/* vLLM's chained block hashes, the one loop every caller shares: the keys of `blocks`
 * consecutive `step`-byte blocks of `data`, each block's key its XXH3-64 seeded with the
 * previous key, the first seeded with `seed`. Key b goes to keys[b] as a new int (a list's or
 * tuple's item array, or a plain array; slots past a failure stay as they were, NULL for a new
 * list or tuple) and, where `values` is not NULL, to values[b]. Returns 0, or -1 with an
 * exception set (out of memory). */
static int chain_hashes(const char *data, Py_ssize_t blocks, size_t step, uint64_t seed,
                        uint64_t *values, PyObject **keys) {
    XXH64_hash_t h = (XXH64_hash_t)seed;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        h = XXH3_64bits_withSeed(data + (size_t)b * step, step, h);
        if (values != NULL) values[b] = h;
        keys[b] = PyLong_FromUnsignedLongLong(h);
        if (keys[b] == NULL) return -1;
    }
    return 0;
}

/* chain_hashes' keys as a new list. */
static PyObject *chained_keys(const char *data, Py_ssize_t blocks, size_t step,
                              unsigned long long seed) {
    PyObject *keys = PyList_New(blocks);
    if (keys == NULL) return NULL;
    if (blocks > 0 && chain_hashes(data, blocks, step, seed, NULL, &PyList_GET_ITEM(keys, 0)) < 0) {
        Py_DECREF(keys);
        return NULL;
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

/* The value block i of a recorded chain gets (the reference's _updated for a known block, its
 * fresh link otherwise): `value` what lookup found (ignored when !known), `last` whether it is
 * the chain's last block, `next_fp` the next block's 16-bit fingerprint. */
static unsigned long long chain_value(unsigned long long value, int known, int last,
                                      unsigned long long next_fp, unsigned long long holder) {
    if (!known) return last ? (holder | REQUEST_END) : (holder | HAS_CHILD | (next_fp << FP_SHIFT));
    value |= holder;
    if (last)
        value |= REQUEST_END;
    else if (!(value & HAS_CHILD))
        value |= HAS_CHILD | (next_fp << FP_SHIFT);
    else if (((value >> FP_SHIFT) & FP_MASK) != next_fp)
        value |= BRANCHING;
    return value;
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
        unsigned long long value = 0;
        if (i < k) {
            value = PyLong_AsUnsignedLongLong(known_items[i]);
            if (value == (unsigned long long)-1 && PyErr_Occurred()) goto done;
        }
        if (set_value(young, key_items[i], chain_value(value, i < k, last, next_fp, holder)) < 0)
            goto done;
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

/* One pass of the walk, block by block: reach_of[r] (blocks held by r from block 0 on; n for
 * those holding all n) is set as replicas drop out; the deepest block every eligible replica
 * holds and the deepest branching one give the common depth. */
typedef struct {
    uint64_t eligible, alive;
    Py_ssize_t deepest_full, deepest_branch;
} Walk;

static void walk_start(Walk *w, uint64_t eligible, Py_ssize_t n, Py_ssize_t *reach_of) {
    for (int r = 0; r < MAX_WALK_REPLICAS; r++) reach_of[r] = n;
    w->eligible = w->alive = eligible;
    w->deepest_full = w->deepest_branch = -1;
}

static inline void walk_step(Walk *w, Py_ssize_t d, uint64_t v, Py_ssize_t *reach_of) {
    uint64_t held = (v >> HOLDERS_SHIFT) & w->eligible;
    if (held == w->eligible) w->deepest_full = d;
    if ((v & (BRANCHING | REQUEST_END)) == BRANCHING) w->deepest_branch = d;
    uint64_t dropped = w->alive & ~held;
    while (dropped) {
        int r = __builtin_ctzll(dropped);
        reach_of[r] = d;
        dropped &= dropped - 1;
    }
    w->alive &= held;
}

static Py_ssize_t walk_common(const Walk *w) {
    return w->deepest_full > w->deepest_branch ? w->deepest_full + 1 : w->deepest_branch + 1;
}

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
    Py_ssize_t reach_of[MAX_WALK_REPLICAS];
    Walk walk;
    walk_start(&walk, eligible, n, reach_of);
    for (Py_ssize_t d = 0; d < n; d++) {
        if (!PyLong_CheckExact(value_items[d])) goto fallback;
        unsigned long long v = PyLong_AsUnsignedLongLong(value_items[d]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
        walk_step(&walk, d, v, reach_of);
    }
    Py_ssize_t common = walk_common(&walk);
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

/* Packs `count` Python ints into out as uint32; 0 when one is not an int in 0..2**32-1 (the
 * reference then packs 64-bit ids, or raises). */
static int pack_ids(PyObject **items, Py_ssize_t count, uint32_t *out) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyLong_CheckExact(items[i])) return 0;
        unsigned long long id = PyLong_AsUnsignedLongLong(items[i]);
        if (id == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (id > MAX_TOKEN_ID) return 0;
        out[i] = (uint32_t)id;
    }
    return 1;
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
    if (!pack_ids(PySequence_Fast_ITEMS(completion), generated, ids + tail)) goto fallback;
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

/* ---------------------------------------------------------------------------------------------
 * route_tokens: Router.route's common case in one call (proxy/core/router.py, the reference).
 *
 *   route_tokens(index, policy, kind, tokens, block_size, seed, loads, capacity, decision)
 *       -> Decision | None
 *
 * A token-id prompt (`tokens`: any buffer of fixed-width ids, an array('I') in the proxy) under
 * a prefix policy (`kind` 0: CostBased, 1: PrefixAffinity), no KV-event view, FastHasher's
 * chain (`seed`: the namespace's), PrefixIndex's storage (`index._young` / `._old`, the
 * dicts both paths read and write). In order, as the reference does it:
 *   hasher.hash_tokens -> index.lookup (promotions and generation turns included) ->
 *   index.reach over the matchable blocks -> the candidates -> policy.choose (its arithmetic
 *   in cost_choose / prefix_choose below, its state read from and written back to `policy`)
 *   -> index.record of the chosen replica -> Decision(replica, outcome, matched, blocks).
 * Returns None, having changed nothing, where the reference must decide: no loads, more than
 * 64, a load entry that is not a (small int, int or integral float below 2**40) tuple, a
 * replica outside 0..min(index.max_replicas, MAX_WALK_REPLICAS)-1, a capacity that is not a
 * 64-bit int, policy state or model constants that are not plain numbers, a chain longer than
 * half the index (record's one-by-one path), or a buffer that is not whole ids. Integral loads
 * keep every load sum exact, so the order of additions cannot differ from Python's.
 * ------------------------------------------------------------------------------------------- */

/* policy.CONCURRENCY_MEMORY_DECISIONS; Router checks the module's copy against it. */
#define CONCURRENCY_MEMORY_DECISIONS 1024

static PyObject *s_young, *s_old, *s_half, *s_evictions, *s_max_replicas, *s_concurrency,
    *s_turn, *s_model, *s_prefill, *s_decode_seq, *s_output, *s_step_base, *s_imbalance,
    *s_replica, *s_outcome, *s_matched_blocks, *s_blocks, *s_affinity, *s_spilled, *s_unmatched,
    *empty_tuple;

/* One eligible replica as the policy sees it (policy.py's Candidate). */
typedef struct {
    double load;         /* Candidate.load (integral, |load| < 2**40) */
    long long matched;   /* Candidate.matched */
    long long new_tokens;
    long long prompt;    /* Candidate.prompt_tokens */
    long long capacity;  /* Candidate.kv_capacity_tokens */
} Cand;

/* CostModel's fields (policy.py). */
typedef struct {
    double prefill, decode_seq, output, step_base;
} Model;

/* _RoundRobinTies._pick over the candidates whose index is in tied[0..count): the only one, or
 * the next in turn (the turn advances only on a real tie). */
static Py_ssize_t pick_tied(const Py_ssize_t *tied, Py_ssize_t count, long long *turn) {
    if (count == 1) return tied[0];
    *turn += 1;
    long long at = *turn % count;
    if (at < 0) at += count; /* Python's % of a negative turn */
    return tied[at];
}

/* CostModel.cost, line by line (policy.py). Every operation is the reference's, in its order,
 * on doubles (-ffp-contract=off in setup.py: no fused multiply-add), so equal inputs give the
 * reference's bits. Python int operands are exact in a double here (< 2**53). */
static double model_cost(const Model *m, const Cand *c, long long duplicate_tokens,
                         double projected_waiting) {
    /* load = candidate.load if candidate.load > 0.0 else 0.0 */
    double load = c->load > 0.0 ? c->load : 0.0;
    /* new_tokens = candidate.new_tokens if candidate.new_tokens > 0 else 0 */
    long long new_tokens = c->new_tokens > 0 ? c->new_tokens : 0;
    /* output = self.expected_output_tokens */
    double output = m->output;
    /* cost = new_tokens * self.prefill_s_per_token * (1.0 + load) */
    double cost = (double)new_tokens * m->prefill * (1.0 + load);
    /* cost += 2.0 * load * output * self.decode_s_per_seq_step */
    cost += 2.0 * load * output * m->decode_seq;
    /* capacity = candidate.kv_capacity_tokens; if capacity > 0: */
    long long capacity = c->capacity;
    if (capacity > 0) {
        /* slots = capacity / (max(candidate.prompt_tokens, 0) + output) */
        double slots = (double)capacity / ((double)(c->prompt > 0 ? c->prompt : 0) + output);
        /* now = (load + 1.0 - slots) * (new_tokens + output) */
        double now = (load + 1.0 - slots) * ((double)new_tokens + output);
        /* projected = projected_waiting * duplicate_tokens */
        double projected = projected_waiting * (double)duplicate_tokens;
        /* blocked = max(now, projected) */
        double blocked = projected > now ? projected : now;
        /* if blocked > 0.0: */
        if (blocked > 0.0) {
            /* hold_s = output * (self.decode_step_base_s + self.decode_s_per_seq_step * slots) */
            double hold_s = output * (m->step_base + m->decode_seq * slots);
            /* cost += blocked / capacity * hold_s */
            cost += blocked / (double)capacity * hold_s;
        }
    }
    return cost;
}

/* CostModel.slots: capacity / (max(prompt_tokens, 0) + expected_output_tokens) */
static double model_slots(const Model *m, const Cand *c) {
    double context = (double)(c->prompt > 0 ? c->prompt : 0) + m->output;
    return (double)c->capacity / context;
}

/* CostModel.hold_seconds: output * (decode_step_base_s + decode_s_per_seq_step * slots) */
static double model_hold_seconds(const Model *m, double slots) {
    return m->output * (m->step_base + m->decode_seq * slots);
}

/* sum() of floats as this CPython computes it (the reference's `sum(waits)`): from 3.12 on,
 * Neumaier-compensated; before, left to right. The start 0 + waits[0] is waits[0]. */
static double python_float_sum(const double *x, Py_ssize_t n) {
    if (n == 0) return 0.0;
    double f = 0.0 + x[0];
#if PY_VERSION_HEX >= 0x030C0000
    double c = 0.0;
    for (Py_ssize_t i = 1; i < n; i++) {
        double t = f + x[i];
        if (fabs(f) >= fabs(x[i]))
            c += (f - t) + x[i];
        else
            c += (x[i] - t) + f;
        f = t;
    }
    if (c && isfinite(c)) f += c;
#else
    for (Py_ssize_t i = 1; i < n; i++) f += x[i];
#endif
    return f;
}

/* CostBased.choose (policy.py), the index of the candidate picked. `costs`, `tied`: scratch of
 * n entries. Reads and writes the policy's learned concurrency and tie turn. Each block below
 * is the method named in its comment, with the reference's lines quoted where they compute. */
static Py_ssize_t cost_choose(const Model *m, const Cand *cands, Py_ssize_t n, double *costs,
                              Py_ssize_t *tied, double *concurrency, long long *turn) {
    /* -- _projected_excess(candidates) -- */
    /* in_flight = 1.0 + sum(c.load for c in candidates if c.load > 0.0)  (exact: integral) */
    double loads = 0.0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (cands[i].load > 0.0) loads += cands[i].load;
    double in_flight = 1.0 + loads;
    /* decayed = self.concurrency * (1.0 - 1.0 / CONCURRENCY_MEMORY_DECISIONS) */
    double decayed = *concurrency * (1.0 - 1.0 / CONCURRENCY_MEMORY_DECISIONS);
    /* self.concurrency = max(in_flight, decayed) */
    *concurrency = decayed > in_flight ? decayed : in_flight;
    double excess = 0.0;
    long long fleet_capacity = 0;
    int capacities_known = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* if c.kv_capacity_tokens <= 0: return 0.0, 0 */
        if (cands[i].capacity <= 0) {
            capacities_known = 0;
            fleet_capacity = 0;
            break;
        }
        fleet_capacity += cands[i].capacity;
    }
    if (capacities_known) {
        /* context = max(candidates[0].prompt_tokens, 0) + self.model.expected_output_tokens */
        double context = (double)(cands[0].prompt > 0 ? cands[0].prompt : 0) + m->output;
        /* return self.concurrency - fleet_capacity / context, fleet_capacity */
        excess = *concurrency - (double)fleet_capacity / context;
    }

    /* -- choose -- */
    /* fewest_new = min(max(c.new_tokens, 0) for c in candidates) if excess > 0.0 else 0 */
    long long fewest_new = 0;
    if (excess > 0.0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            long long nt = cands[i].new_tokens > 0 ? cands[i].new_tokens : 0;
            if (i == 0 || nt < fewest_new) fewest_new = nt;
        }
    }
    /* if excess > 0.0 and self._holder_has_room(candidates, fewest_new): */
    int room = 0;
    if (excess > 0.0) {
        /* -- _holder_has_room -- */
        for (Py_ssize_t i = 0; i < n && !room; i++) {
            const Cand *c = &cands[i];
            /* max(c.new_tokens, 0) == fewest_new and max(c.load, 0.0) + 1.0 <= slots(c) */
            long long nt = c->new_tokens > 0 ? c->new_tokens : 0;
            if (nt == fewest_new && (c->load > 0.0 ? c->load : 0.0) + 1.0 <= model_slots(m, c))
                room = 1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const Cand *c = &cands[i];
        if (room)
            /* cost(c, duplicate_tokens=max(c.new_tokens, 0) - fewest_new,
             *      projected_waiting=excess * c.kv_capacity_tokens / fleet_capacity) */
            costs[i] = model_cost(m, c, (c->new_tokens > 0 ? c->new_tokens : 0) - fewest_new,
                                  excess * (double)c->capacity / (double)fleet_capacity);
        else
            costs[i] = model_cost(m, c, 0, 0.0); /* self.model.cost(c) */
    }

    /* -- _own_wait_beyond_fleet -- ; costs = [cost + wait ...] when it is not None */
    int own_wait = 1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (cands[i].capacity <= 0) own_wait = 0; /* unknown capacity: return None */
    if (own_wait) {
        double waits[64], holds[64];
        for (Py_ssize_t i = 0; i < n; i++) {
            const Cand *c = &cands[i];
            double slots = model_slots(m, c);              /* slots = model.slots(c) */
            double hold_s = model_hold_seconds(m, slots);  /* hold_s = model.hold_seconds(slots) */
            /* queued = max(c.load, 0.0) + 1.0 - slots */
            double queued = (c->load > 0.0 ? c->load : 0.0) + 1.0 - slots;
            /* waits.append(queued * hold_s / slots if queued > 0.0 else 0.0) */
            waits[i] = queued > 0.0 ? queued * hold_s / slots : 0.0;
            holds[i] = hold_s;
        }
        /* mean = sum(waits) / len(waits); if mean <= 0.0: return None */
        double mean = python_float_sum(waits, n) / (double)n;
        if (mean > 0.0) {
            for (Py_ssize_t i = 0; i < n; i++) {
                /* beyond = wait - mean - hold_s; b if b > 0.0 else 0.0 */
                double beyond = waits[i] - mean - holds[i];
                costs[i] = costs[i] + (beyond > 0.0 ? beyond : 0.0);
            }
        }
    }
    /* low = min(costs) */
    double low = costs[0];
    for (Py_ssize_t i = 1; i < n; i++)
        if (costs[i] < low) low = costs[i];
    /* pick = self._pick([c for c, cost in zip(candidates, costs) if cost == low]) */
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (costs[i] == low) tied[count++] = i;
    return pick_tied(tied, count, turn);
}

/* _RoundRobinTies._least_loaded over the candidates indexed by among[0..count). */
static Py_ssize_t least_loaded(const Cand *cands, const Py_ssize_t *among, Py_ssize_t count,
                               Py_ssize_t *tied, long long *turn) {
    /* low = min(c.load for c in candidates) */
    double low = cands[among[0]].load;
    for (Py_ssize_t i = 1; i < count; i++)
        if (cands[among[i]].load < low) low = cands[among[i]].load;
    /* return self._pick([c for c in candidates if c.load == low]) */
    Py_ssize_t tied_count = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        if (cands[among[i]].load == low) tied[tied_count++] = among[i];
    return pick_tied(tied, tied_count, turn);
}

/* PrefixAffinity.choose (policy.py): the index picked; *affinity set when its outcome is
 * "affinity" (then matched is best_match), else the caller derives spilled / unmatched. */
static Py_ssize_t prefix_choose(const Cand *cands, Py_ssize_t n, double imbalance,
                                Py_ssize_t *scratch, Py_ssize_t *tied, long long *turn,
                                int *affinity) {
    *affinity = 0;
    /* best_match = max(c.matched for c in candidates) */
    long long best_match = cands[0].matched;
    for (Py_ssize_t i = 1; i < n; i++)
        if (cands[i].matched > best_match) best_match = cands[i].matched;
    Py_ssize_t all[64];
    for (Py_ssize_t i = 0; i < n; i++) all[i] = i;
    if (best_match > 0) {
        /* matching = [c for c in candidates if c.matched == best_match] */
        Py_ssize_t count = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (cands[i].matched == best_match) scratch[count++] = i;
        /* best = self._least_loaded(matching) */
        Py_ssize_t best = least_loaded(cands, scratch, count, tied, turn);
        /* floor = min(c.load for c in candidates) */
        double floor = cands[0].load;
        for (Py_ssize_t i = 1; i < n; i++)
            if (cands[i].load < floor) floor = cands[i].load;
        /* if best.load - floor <= self.imbalance: affinity */
        if (cands[best].load - floor <= imbalance) {
            *affinity = 1;
            return best;
        }
        /* spill = self._least_loaded(candidates) */
        return least_loaded(cands, all, n, tied, turn);
    }
    /* pick = self._least_loaded(candidates) */
    return least_loaded(cands, all, n, tied, turn);
}

/* The index's two generations as the reference's PrefixIndex holds them (prefix_index.py):
 * `young` and `old` are the index's current dicts; a turn replaces them on the index too. */
typedef struct {
    PyObject *index; /* borrowed */
    PyObject *young, *old;
    Py_ssize_t half;
    int turns; /* generation turns made through this struct */
} Gens;

/* How many replicas the index's C path takes: min(index.max_replicas, MAX_WALK_REPLICAS);
 * -1 on error. */
static long replica_limit(PyObject *index) {
    PyObject *max_replicas_obj = PyObject_GetAttr(index, s_max_replicas);
    if (max_replicas_obj == NULL) return -1;
    long max_replicas = PyLong_AsLong(max_replicas_obj);
    Py_DECREF(max_replicas_obj);
    if (max_replicas == -1 && PyErr_Occurred()) return -1;
    return max_replicas > MAX_WALK_REPLICAS ? MAX_WALK_REPLICAS : max_replicas;
}

/* Reads the index's two generations into g (new references, released by the caller). */
static int gens_open(Gens *g) {
    g->young = PyObject_GetAttr(g->index, s_young);
    g->old = g->young ? PyObject_GetAttr(g->index, s_old) : NULL;
    if (g->old == NULL) return -1;
    if (!PyDict_CheckExact(g->young) || !PyDict_CheckExact(g->old)) {
        PyErr_SetString(PyExc_TypeError, "the index's generations must be dicts");
        return -1;
    }
    return 0;
}

/* PrefixIndex._put's (and record's) turn: evictions += len(old); old = young; young = {}. */
static int gens_turn(Gens *g) {
    PyObject *evictions = PyObject_GetAttr(g->index, s_evictions);
    if (evictions == NULL) return -1;
    PyObject *dropped = PyLong_FromSsize_t(PyDict_GET_SIZE(g->old));
    PyObject *sum = dropped ? PyNumber_Add(evictions, dropped) : NULL;
    Py_DECREF(evictions);
    Py_XDECREF(dropped);
    if (sum == NULL) return -1;
    int rc = PyObject_SetAttr(g->index, s_evictions, sum);
    Py_DECREF(sum);
    if (rc < 0) return -1;
    PyObject *fresh = PyDict_New();
    if (fresh == NULL) return -1;
    if (PyObject_SetAttr(g->index, s_old, g->young) < 0 ||
        PyObject_SetAttr(g->index, s_young, fresh) < 0) {
        Py_DECREF(fresh);
        return -1;
    }
    Py_SETREF(g->old, g->young);
    g->young = fresh;
    g->turns++;
    return 0;
}

static int as_u64(PyObject *value, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* PrefixIndex.lookup(keys): the values of the leading known keys into values[], their count
 * returned (-1: error). Young hits first, then from the first miss on each key through _get:
 * young, else popped from old and put back into young (a turn when young is full). */
static Py_ssize_t gens_lookup(Gens *g, PyObject **keys, Py_ssize_t n, uint64_t *values) {
    Py_ssize_t k = 0;
    for (; k < n; k++) {
        PyObject *v = PyDict_GetItemWithError(g->young, keys[k]);
        if (v == NULL) {
            if (PyErr_Occurred()) return -1;
            break;
        }
        if (as_u64(v, &values[k]) < 0) return -1;
    }
    for (; k < n; k++) {
        PyObject *v = PyDict_GetItemWithError(g->young, keys[k]);
        if (v != NULL) {
            if (as_u64(v, &values[k]) < 0) return -1;
            continue;
        }
        if (PyErr_Occurred()) return -1;
        v = PyDict_GetItemWithError(g->old, keys[k]); /* value = self._old.pop(key, None) */
        if (v == NULL) {
            if (PyErr_Occurred()) return -1;
            break;
        }
        Py_INCREF(v);
        int rc = PyDict_DelItem(g->old, keys[k]);
        /* self._put(key, value): the key is not in young (looked up just above) */
        if (rc == 0 && PyDict_GET_SIZE(g->young) >= g->half) rc = gens_turn(g);
        if (rc == 0) rc = PyDict_SetItem(g->young, keys[k], v);
        if (rc == 0) rc = as_u64(v, &values[k]);
        Py_DECREF(v);
        if (rc < 0) return -1;
    }
    return k;
}

/* PrefixIndex.record(keys, replica, known) for a chain of n <= half blocks: a turn first when
 * young cannot take the chain, then record_chain's values. */
static int gens_record(Gens *g, PyObject **keys, const uint64_t *key_values, Py_ssize_t n,
                       const uint64_t *known, Py_ssize_t k, uint64_t holder) {
    /* Known blocks sit in young (found there or promoted by the lookup) unless a turn since
     * the lookup began moved them to old: only then must an unchanged value be written again.
     * Otherwise an unchanged value is not stored (the reference stores an equal int in place:
     * same dict, same order), the common case of a prompt sent again where it is held. */
    if (PyDict_GET_SIZE(g->young) + n > g->half && gens_turn(g) < 0) return -1;
    int turned = g->turns > 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int last = (i == n - 1);
        uint64_t next_fp = last ? 0 : (key_values[i + 1] & FP_MASK);
        uint64_t value = chain_value(i < k ? known[i] : 0, i < k, last, next_fp, holder);
        if (i < k && !turned && value == known[i]) continue;
        if (set_value(g->young, keys[i], value) < 0) return -1;
    }
    return 0;
}

/* A float attribute of obj (an exact float, or where `int_ok` a small int, read exactly); *ok = 0
 * when it is neither, -1 on error. The model's constants must be floats: an int constant would
 * make the reference multiply ints exactly where this multiplies doubles. */
static int float_attr(PyObject *obj, PyObject *name, int int_ok, double *out, int *ok) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
    } else if (int_ok && PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || x > (1ll << 40) || x < -(1ll << 40)) *ok = 0;
        *out = (double)x;
    } else {
        *ok = 0;
    }
    Py_DECREF(v);
    return 0;
}

/* An integral load below 2**40 in magnitude, as a double; 0 when the reference must decide. */
static int plain_load(PyObject *v, double *out) {
    double x;
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long i = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow) return 0;
        x = (double)i;
    } else if (PyFloat_CheckExact(v)) {
        x = PyFloat_AS_DOUBLE(v);
        if (x != floor(x)) return 0; /* a fraction, or nan / inf */
    } else {
        return 0;
    }
    if (x >= 1099511627776.0 || x <= -1099511627776.0) return 0;
    *out = x;
    return 1;
}

static PyObject *make_decision(PyObject *decision_type, PyObject *replica, PyObject *outcome,
                               long long matched, PyObject *blocks) {
    PyTypeObject *type = (PyTypeObject *)decision_type;
    /* Decision.__new__ (object's) and its four slots set: the dataclass __init__ would cost a
     * Python frame per request for the same four stores. */
    PyObject *decision = type->tp_new(type, empty_tuple, NULL);
    if (decision == NULL) return NULL;
    PyObject *m = PyLong_FromLongLong(matched);
    if (m == NULL || PyObject_SetAttr(decision, s_replica, replica) < 0 ||
        PyObject_SetAttr(decision, s_outcome, outcome) < 0 ||
        PyObject_SetAttr(decision, s_matched_blocks, m) < 0 ||
        PyObject_SetAttr(decision, s_blocks, blocks) < 0) {
        Py_XDECREF(m);
        Py_DECREF(decision);
        return NULL;
    }
    Py_DECREF(m);
    return decision;
}

#define POLICY_COST 0
#define POLICY_PREFIX 1

static PyObject *route_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 || !PyType_Check(args[8]) || !PyDict_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError,
                        "route_tokens(index, policy, kind, tokens, block_size, seed, loads, "
                        "capacity: dict, decision: type)");
        return NULL;
    }
    PyObject *index = args[0], *policy = args[1], *capacity = args[7], *decision_type = args[8];
    long kind = PyLong_AsLong(args[2]);
    if (kind == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t block_size = PyLong_AsSsize_t(args[4]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size < 1 || (kind != POLICY_COST && kind != POLICY_PREFIX)) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1 and kind 0 or 1");
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[5]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;

    PyObject *result = NULL, *loads = NULL, *blocks = NULL, *model = NULL, *replica_obj = NULL;
    Gens g = {index, NULL, NULL, 0, 0};
    uint64_t *key_values = NULL;
    Py_buffer view;
    view.obj = NULL;
    Cand cands[64];
    PyObject *replica_objs[64];
    long replicas[64];
    double costs[64];
    Py_ssize_t tied[64], scratch[64];

    /* -- what the reference would refuse or compute differently: None, nothing changed -- */
    loads = PySequence_Fast(args[6], "loads must be a sequence");
    if (loads == NULL) return NULL;
    Py_ssize_t n_cands = PySequence_Fast_GET_SIZE(loads);
    if (n_cands < 1 || n_cands > 64) goto fallback;
    long max_replicas = replica_limit(index);
    if (max_replicas < 0) goto done;
    PyObject **load_items = PySequence_Fast_ITEMS(loads);
    uint64_t eligible = 0;
    for (Py_ssize_t i = 0; i < n_cands; i++) {
        PyObject *item = load_items[i];
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) goto fallback;
        PyObject *r_obj = PyTuple_GET_ITEM(item, 0);
        if (!PyLong_CheckExact(r_obj)) goto fallback;
        long r = PyLong_AsLong(r_obj);
        if (r == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
        if (r < 0 || r >= max_replicas) goto fallback;
        if (!plain_load(PyTuple_GET_ITEM(item, 1), &cands[i].load)) goto fallback;
        /* capacity.get(r, 0) */
        PyObject *cap = PyDict_GetItemWithError(capacity, r_obj);
        long long cap_value = 0;
        if (cap == NULL) {
            if (PyErr_Occurred()) goto done;
        } else {
            if (!PyLong_CheckExact(cap)) goto fallback;
            int overflow = 0;
            cap_value = PyLong_AsLongLongAndOverflow(cap, &overflow);
            if (overflow || cap_value > (1ll << 52) || cap_value < -(1ll << 52)) goto fallback;
        }
        cands[i].capacity = cap_value;
        replicas[i] = r;
        replica_objs[i] = r_obj;
        eligible |= 1ull << r;
    }
    Model m = {0, 0, 0, 0};
    double concurrency = 0.0, imbalance = 0.0;
    int ok = 1;
    if (kind == POLICY_COST) {
        model = PyObject_GetAttr(policy, s_model);
        if (model == NULL || float_attr(model, s_prefill, 0, &m.prefill, &ok) < 0 ||
            float_attr(model, s_decode_seq, 0, &m.decode_seq, &ok) < 0 ||
            float_attr(model, s_output, 0, &m.output, &ok) < 0 ||
            float_attr(model, s_step_base, 0, &m.step_base, &ok) < 0 ||
            float_attr(policy, s_concurrency, 1, &concurrency, &ok) < 0)
            goto done;
    } else if (float_attr(policy, s_imbalance, 1, &imbalance, &ok) < 0) {
        goto done;
    }
    if (!ok) goto fallback;
    PyObject *turn_obj = PyObject_GetAttr(policy, s_turn);
    if (turn_obj == NULL) goto done;
    int overflow = 0;
    long long turn = PyLong_Check(turn_obj) ? PyLong_AsLongLongAndOverflow(turn_obj, &overflow) : 0;
    int turn_plain = PyLong_Check(turn_obj) && !overflow && turn < (1ll << 62);
    Py_DECREF(turn_obj);
    if (!turn_plain) goto fallback;
    long long turn_before = turn;
    PyObject *half_obj = PyObject_GetAttr(index, s_half);
    if (half_obj == NULL) goto done;
    g.half = PyLong_AsSsize_t(half_obj);
    Py_DECREF(half_obj);
    if (g.half == -1 && PyErr_Occurred()) goto done;
    if (PyObject_GetBuffer(args[3], &view, PyBUF_ND | PyBUF_FORMAT) < 0) goto done;
    if (view.itemsize < 1 || view.len % view.itemsize != 0) goto fallback;
    Py_ssize_t length = view.len / view.itemsize; /* key.length */
    Py_ssize_t n = length / block_size;
    if (n > g.half) goto fallback; /* record's one-by-one path for a tiny index */

    /* -- blocks = self.block_keys(key, lora_path) -- */
    key_values = PyMem_Malloc((size_t)(2 * n + 1) * sizeof(uint64_t));
    if (key_values == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *values = key_values + n;
    blocks = PyTuple_New(n);
    if (blocks == NULL) goto done;
    if (n > 0 && chain_hashes(view.buf, n, (size_t)block_size * (size_t)view.itemsize, seed,
                              key_values, &PyTuple_GET_ITEM(blocks, 0)) < 0)
        goto done;
    PyObject **keys = &PyTuple_GET_ITEM(blocks, 0);

    /* -- values = self.index.lookup(blocks) -- */
    if (gens_open(&g) < 0) goto done;
    Py_ssize_t k = gens_lookup(&g, keys, n, values);
    if (k < 0) goto done;

    /* -- reach, common = self.index.reach(values, matchable, replicas) -- */
    /* matchable = max(0, (key.length - 1) // bs) */
    Py_ssize_t matchable = length >= 1 ? (length - 1) / block_size : 0;
    if (matchable > k) matchable = k;
    Py_ssize_t reach_of[MAX_WALK_REPLICAS];
    Walk walk;
    walk_start(&walk, eligible, matchable, reach_of);
    for (Py_ssize_t d = 0; d < matchable; d++) walk_step(&walk, d, values[d], reach_of);
    Py_ssize_t common = walk_common(&walk);

    /* -- the candidates -- */
    for (Py_ssize_t i = 0; i < n_cands; i++) {
        Py_ssize_t d = reach_of[replicas[i]];
        cands[i].matched = d > common ? d - common : 0;   /* matched = d - common if d > common */
        Py_ssize_t held = d > common ? d : common;        /* held = max(d, common) */
        cands[i].new_tokens = (long long)length - (long long)held * block_size;
        cands[i].prompt = length;
    }

    /* -- decision = self.policy.choose(candidates) -- */
    Py_ssize_t pick;
    PyObject *outcome;
    long long matched;
    long long best_match = 0;
    for (Py_ssize_t i = 0; i < n_cands; i++)
        if (cands[i].matched > best_match) best_match = cands[i].matched;
    if (kind == POLICY_COST) {
        pick = cost_choose(&m, cands, n_cands, costs, tied, &concurrency, &turn);
        if (best_match == 0) {
            outcome = s_unmatched;
            matched = 0;
        } else {
            outcome = cands[pick].matched == best_match ? s_affinity : s_spilled;
            matched = cands[pick].matched;
        }
        PyObject *c = PyFloat_FromDouble(concurrency);
        int rc = c ? PyObject_SetAttr(policy, s_concurrency, c) : -1;
        Py_XDECREF(c);
        if (rc < 0) goto done;
    } else {
        int affinity;
        pick = prefix_choose(cands, n_cands, imbalance, scratch, tied, &turn, &affinity);
        if (affinity) {
            outcome = s_affinity;
            matched = best_match;
        } else if (best_match > 0) {
            outcome = s_spilled;
            matched = cands[pick].matched;
        } else {
            outcome = s_unmatched;
            matched = 0;
        }
    }
    if (turn != turn_before) { /* self._turn += 1, on a real tie only */
        PyObject *t = PyLong_FromLongLong(turn);
        int rc = t ? PyObject_SetAttr(policy, s_turn, t) : -1;
        Py_XDECREF(t);
        if (rc < 0) goto done;
    }

    /* -- self.index.record(blocks, decision.replica, values) -- */
    uint64_t holder = (1ull << replicas[pick]) << HOLDERS_SHIFT;
    if (gens_record(&g, keys, key_values, n, values, k, holder) < 0) goto done;
    /* -- decision.blocks = tuple(blocks) -- */
    replica_obj = replica_objs[pick];
    result = make_decision(decision_type, replica_obj, outcome, matched, blocks);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    if (view.obj != NULL) PyBuffer_Release(&view);
    PyMem_Free(key_values);
    Py_XDECREF(blocks);
    Py_XDECREF(model);
    Py_XDECREF(g.young);
    Py_XDECREF(g.old);
    Py_DECREF(loads);
    return result;
}

/* ---------------------------------------------------------------------------------------------
 * learn_tokens: Router.record_completion's token-id case in one call (router.py, the reference).
 *
 *   learn_tokens(index, tokens, completion, block_size, blocks, replica) -> True | None
 *
 * `tokens` an array('I') prompt whose full blocks are `blocks` (a Decision's block keys, a
 * tuple), `completion` the generated ids. As the reference: the chain continued from the
 * prompt's last block through its tail and the completion (extend_chain), then
 * index.lookup([last, *more]); found: index.record of that chain with what was found; not
 * (the index was cleared since routing): index.record(blocks + more) from a fresh lookup.
 * Returns None, having changed nothing, where the reference must decide: a prompt with no full
 * block or whose blocks do not match it, ids that are not uint32, a replica outside
 * 0..min(index.max_replicas, MAX_WALK_REPLICAS)-1, or a chain longer than half the index.
 * ------------------------------------------------------------------------------------------- */
static PyObject *learn_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "learn_tokens(index, tokens, completion, block_size, blocks, replica)");
        return NULL;
    }
    PyObject *index = args[0], *blocks = args[4], *replica_obj = args[5];
    Py_ssize_t block_size = PyLong_AsSsize_t(args[3]);
    if (block_size == -1 && PyErr_Occurred()) return NULL;
    if (block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1");
        return NULL;
    }
    PyObject *completion = PySequence_Fast(args[2], "completion must be a sequence");
    if (completion == NULL) return NULL;
    PyObject *result = NULL, **keys = NULL;
    Py_ssize_t n_keys = 0;
    uint64_t *key_values = NULL;
    uint32_t *ids = NULL;
    Gens g = {index, NULL, NULL, 0, 0};
    Py_buffer view;
    view.obj = NULL;
    if (!PyTuple_CheckExact(blocks) || !PyLong_CheckExact(replica_obj)) goto fallback;
    long replica = PyLong_AsLong(replica_obj);
    if (replica == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto fallback;
    }
    long max_replicas = replica_limit(index);
    if (max_replicas < 0) goto done;
    if (replica < 0 || replica >= max_replicas) goto fallback;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_ND | PyBUF_FORMAT) < 0) goto done;
    if (view.itemsize != 4 || view.format == NULL || strcmp(view.format, "I") != 0) goto fallback;
    Py_ssize_t prompt_len = view.len / 4;
    Py_ssize_t full = prompt_len / block_size, n_blocks = PyTuple_GET_SIZE(blocks);
    /* if full and len(decision.blocks) == full: */
    if (full == 0 || n_blocks != full) goto fallback;
    PyObject *half_obj = PyObject_GetAttr(index, s_half);
    if (half_obj == NULL) goto done;
    g.half = PyLong_AsSsize_t(half_obj);
    Py_DECREF(half_obj);
    if (g.half == -1 && PyErr_Occurred()) goto done;

    /* more = extend_tail(last, key.tokens, full * bs, completion): extend_chain's packing */
    Py_ssize_t tail = prompt_len - full * block_size;
    Py_ssize_t generated = PySequence_Fast_GET_SIZE(completion);
    Py_ssize_t total = tail + generated;
    Py_ssize_t n_more = total / block_size;
    if (n_blocks + n_more > g.half) goto fallback; /* record's one-by-one path: the reference */
    ids = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(uint32_t));
    n_keys = n_blocks + n_more;
    key_values = PyMem_Malloc((size_t)(2 * n_keys) * sizeof(uint64_t));
    keys = PyMem_Calloc((size_t)n_keys, sizeof(PyObject *));
    if (ids == NULL || key_values == NULL || keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *values = key_values + n_keys;
    if (tail) memcpy(ids, (const char *)view.buf + full * block_size * 4, (size_t)tail * 4);
    if (!pack_ids(PySequence_Fast_ITEMS(completion), generated, ids + tail)) goto fallback;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        PyObject *key = PyTuple_GET_ITEM(blocks, b);
        if (!PyLong_CheckExact(key)) goto fallback;
        unsigned long long v = PyLong_AsUnsignedLongLong(key);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto fallback;
        }
        key_values[b] = v;
        keys[b] = Py_NewRef(key);
    }
    if (chain_hashes((const char *)ids, n_more, (size_t)block_size * 4, key_values[n_blocks - 1],
                     key_values + n_blocks, keys + n_blocks) < 0)
        goto done;

    if (gens_open(&g) < 0) goto done;
    uint64_t holder = (1ull << replica) << HOLDERS_SHIFT;
    /* keys = [last, *more]; known = self.index.lookup(keys) */
    PyObject **chain_keys = keys + n_blocks - 1;
    uint64_t *chain_values = key_values + n_blocks - 1;
    Py_ssize_t k = gens_lookup(&g, chain_keys, 1 + n_more, values);
    if (k < 0) goto done;
    if (k > 0) {
        /* self.index.record(keys, decision.replica, known) */
        if (gens_record(&g, chain_keys, chain_values, 1 + n_more, values, k, holder) < 0)
            goto done;
    } else {
        /* self.index.record(list(decision.blocks) + more, decision.replica): looked up first */
        k = gens_lookup(&g, keys, n_keys, values);
        if (k < 0 || gens_record(&g, keys, key_values, n_keys, values, k, holder) < 0) goto done;
    }
    result = Py_NewRef(Py_True);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    if (view.obj != NULL) PyBuffer_Release(&view);
    if (keys != NULL)
        for (Py_ssize_t i = 0; i < n_keys; i++) Py_XDECREF(keys[i]);
    PyMem_Free(keys);
    PyMem_Free(key_values);
    PyMem_Free(ids);
    Py_XDECREF(g.young);
    Py_XDECREF(g.old);
    Py_DECREF(completion);
    return result;
}

/* ---------------------------------------------------------------------------------------------
 * The events views' per-key loops (proxy/core/kv_view.py: _store, _remove, _hold, _release,
 * _expect, _prefix are the reference, tests/unit/test_kv_view_native.py the twin tests). On the
 * memory-tight benchmark every routed request pins and frees ~250 prompt keys on its replica's
 * view and causes ~280 stored / removed keys there; in Python those loops were ~0.5 ms of the
 * events path's ~0.6 ms per request (bench/results/kv_events.md, round 8).
 *
 * The containers are the view's own: `blocks` a dict (key -> None), `pending` an OrderedDict
 * (key -> deadline), `freed` a dict (key -> stamp, least recently freed first: insertion order),
 * `pins` a Counter (key -> requests pinning it), `tick` an itertools.count giving the stamps.
 * The OrderedDict is only written through PyObject_SetItem / PyObject_DelItem, which keep its
 * order; reads go through the dict it is.
 * ------------------------------------------------------------------------------------------- */

static int view_dicts(PyObject *const *args, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyDict_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "the view's containers must be dicts");
            return -1;
        }
    }
    return 0;
}

/* d.pop(key, None) for an OrderedDict (or dict): 1 removed, 0 absent, -1 error. */
static int view_pop(PyObject *d, PyObject *key) {
    int has = PyDict_Contains(d, key);
    if (has <= 0) return has;
    return PyObject_DelItem(d, key) < 0 ? -1 : 1;
}

/* freed[key] = next(tick): the key becomes the most recently freed. */
static int view_stamp(PyObject *freed, PyObject *tick, PyObject *key) {
    PyObject *stamp = PyIter_Next(tick);
    if (stamp == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the view's tick ran out");
        return -1;
    }
    int rc = PyObject_SetItem(freed, key, stamp);
    Py_DECREF(stamp);
    return rc;
}

/* The preamble every view_* shares: `want` arguments, the first `dicts` of them dicts, and
 * args[keys_at] as a fast sequence (a new reference the caller releases), or NULL. */
static PyObject *view_keys(const char *name, PyObject *const *args, Py_ssize_t nargs,
                           Py_ssize_t want, Py_ssize_t dicts, Py_ssize_t keys_at) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return NULL;
    }
    if (view_dicts(args, dicts) < 0) return NULL;
    return PySequence_Fast(args[keys_at], "keys must be a sequence");
}

#define KEYS_ITEMS(keys) PySequence_Fast_ITEMS(keys), PySequence_Fast_GET_SIZE(keys)

/* One BlockStored's keys -> how many were pending, or -1. */
static Py_ssize_t store_keys(PyObject *blocks, PyObject *pending, PyObject *freed, PyObject *pins,
                             PyObject *tick, PyObject **items, Py_ssize_t n) {
    Py_ssize_t confirmed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        if (PyDict_SetItem(blocks, key, Py_None) < 0) return -1;
        if (PyDict_GET_SIZE(pending)) {
            int popped = view_pop(pending, key);
            if (popped < 0) return -1;
            confirmed += popped;
        }
        int pinned = PyDict_Contains(pins, key);
        if (pinned < 0) return -1;
        if (pinned) continue;
        int was = PyDict_Contains(freed, key);
        if (was < 0) return -1;
        if (!was && view_stamp(freed, tick, key) < 0) return -1;
    }
    return confirmed;
}

/* One BlockRemoved's keys -> how many were pending, or -1. */
static Py_ssize_t remove_keys(PyObject *blocks, PyObject *pending, PyObject *freed,
                              PyObject **items, Py_ssize_t n) {
    Py_ssize_t confirmed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        if (view_pop(blocks, key) < 0 || view_pop(freed, key) < 0) return -1;
        if (PyDict_GET_SIZE(pending)) {
            int popped = view_pop(pending, key);
            if (popped < 0) return -1;
            confirmed += popped;
        }
    }
    return confirmed;
}

/* A count as a Python int, or NULL where the loop failed (-1). */
static PyObject *view_count(Py_ssize_t n) { return n < 0 ? NULL : PyLong_FromSsize_t(n); }

/* view_store(blocks, pending, freed, pins, tick, keys) -> confirmed: one BlockStored. */
static PyObject *view_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys = view_keys("view_store", args, nargs, 6, 4, 5);
    if (keys == NULL) return NULL;
    Py_ssize_t confirmed =
        store_keys(args[0], args[1], args[2], args[3], args[4], KEYS_ITEMS(keys));
    Py_DECREF(keys);
    return view_count(confirmed);
}

/* view_remove(blocks, pending, freed, keys) -> confirmed: one BlockRemoved. */
static PyObject *view_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys = view_keys("view_remove", args, nargs, 4, 3, 3);
    if (keys == NULL) return NULL;
    Py_ssize_t confirmed = remove_keys(args[0], args[1], args[2], KEYS_ITEMS(keys));
    Py_DECREF(keys);
    return view_count(confirmed);
}

static PyObject *s_kind, *s_keys, *s_block_stored, *s_block_removed;

/* view_apply(blocks, pending, freed, pins, tick, events, start) -> (confirmed, stop):
 * kv_view._apply, a batch's BlockStored / BlockRemoved events from `start` on in one call (the
 * tight benchmark's batches carry ~140 one-key BlockRemoved each: one call per key before),
 * stopping at the first event of another kind (AllBlocksCleared: the view resets its
 * containers and calls again after it); stop = len(events) when none. */
static PyObject *view_apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *events = view_keys("view_apply", args, nargs, 7, 4, 5);
    if (events == NULL) return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[6]), total = PySequence_Fast_GET_SIZE(events);
    Py_ssize_t confirmed = 0, i = start;
    if (start == -1 && PyErr_Occurred()) goto fail;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "view_apply: start must be >= 0");
        goto fail;
    }
    for (; i < total; i++) {
        PyObject *event = PySequence_Fast_ITEMS(events)[i];
        PyObject *kind = PyObject_GetAttr(event, s_kind);
        if (kind == NULL) goto fail;
        /* event.kind == STORED / REMOVED, as the reference compares them */
        int stored = PyObject_RichCompareBool(kind, s_block_stored, Py_EQ);
        int removed = stored ? 0 : PyObject_RichCompareBool(kind, s_block_removed, Py_EQ);
        Py_DECREF(kind);
        if (stored < 0 || removed < 0) goto fail;
        if (!stored && !removed) break;
        PyObject *value = PyObject_GetAttr(event, s_keys);
        if (value == NULL) goto fail;
        PyObject *keys = PySequence_Fast(value, "keys must be a sequence");
        Py_DECREF(value);
        if (keys == NULL) goto fail;
        Py_ssize_t got = stored ? store_keys(args[0], args[1], args[2], args[3], args[4],
                                             KEYS_ITEMS(keys))
                                : remove_keys(args[0], args[1], args[2], KEYS_ITEMS(keys));
        Py_DECREF(keys);
        if (got < 0) goto fail;
        confirmed += got;
    }
    Py_DECREF(events);
    return Py_BuildValue("(nn)", confirmed, i);
fail:
    Py_DECREF(events);
    return NULL;
}

/* A routed request pins its prompt's keys -> how many must be allocated (not cached), or -1. */
static Py_ssize_t hold_keys(PyObject *pins, PyObject *freed, PyObject *blocks, PyObject **items,
                            Py_ssize_t n) {
    Py_ssize_t fresh = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        PyObject *had = PyDict_GetItemWithError(pins, key); /* borrowed */
        if (had == NULL && PyErr_Occurred()) return -1;
        long pinned = 0;
        if (had != NULL && (pinned = PyLong_AsLong(had)) == -1 && PyErr_Occurred()) return -1;
        PyObject *count = PyLong_FromLong(pinned + 1);
        if (count == NULL) return -1;
        int rc = PyDict_SetItem(pins, key, count);
        Py_DECREF(count);
        if (rc < 0 || view_pop(freed, key) < 0) return -1;
        int cached = PyDict_Contains(blocks, key);
        if (cached < 0) return -1;
        fresh += !cached;
    }
    return fresh;
}

/* view_hold(pins, freed, blocks, keys) -> new: a routed request pins its prompt's keys. */
static PyObject *view_hold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys = view_keys("view_hold", args, nargs, 4, 3, 3);
    if (keys == NULL) return NULL;
    Py_ssize_t fresh = hold_keys(args[0], args[1], args[2], KEYS_ITEMS(keys));
    Py_DECREF(keys);
    return view_count(fresh);
}

/* A request's answer came back: its keys, last first -> 0, or -1. */
static Py_ssize_t release_keys(PyObject *pins, PyObject *freed, PyObject *blocks, PyObject *tick,
                               PyObject **items, Py_ssize_t n) {
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *key = items[i];
        PyObject *had = PyDict_GetItemWithError(pins, key); /* borrowed */
        if (had == NULL && PyErr_Occurred()) return -1;
        if (had != NULL) {
            long pinned = PyLong_AsLong(had);
            if (pinned == -1 && PyErr_Occurred()) return -1;
            if (pinned > 1) {
                PyObject *count = PyLong_FromLong(pinned - 1);
                if (count == NULL) return -1;
                int rc = PyDict_SetItem(pins, key, count);
                Py_DECREF(count);
                if (rc < 0) return -1;
                continue;
            }
            if (PyDict_DelItem(pins, key) < 0) return -1;
        }
        int cached = PyDict_Contains(blocks, key);
        if (cached < 0) return -1;
        if (cached && (view_pop(freed, key) < 0 || view_stamp(freed, tick, key) < 0)) return -1;
    }
    return 0;
}

/* view_release(pins, freed, blocks, tick, keys): a request's answer came back; last key first. */
static PyObject *view_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys = view_keys("view_release", args, nargs, 5, 3, 4);
    if (keys == NULL) return NULL;
    Py_ssize_t rc = release_keys(args[0], args[1], args[2], args[3], KEYS_ITEMS(keys));
    Py_DECREF(keys);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* Keys just sent: the ones not cached pending until `deadline`, newest last -> 0, or -1. */
static Py_ssize_t expect_keys(PyObject *blocks, PyObject *pending, PyObject *deadline,
                              PyObject **items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        int cached = PyDict_Contains(blocks, key);
        if (cached < 0) return -1;
        if (cached) continue;
        /* pending[key] = deadline, moved to the end (the most recent) */
        if (view_pop(pending, key) < 0 || PyObject_SetItem(pending, key, deadline) < 0) return -1;
    }
    return 0;
}

/* view_expect(blocks, pending, keys, deadline): keys just sent, pending until reported. */
static PyObject *view_expect(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys = view_keys("view_expect", args, nargs, 4, 2, 2);
    if (keys == NULL) return NULL;
    Py_ssize_t rc = expect_keys(args[0], args[1], args[3], KEYS_ITEMS(keys));
    Py_DECREF(keys);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* ReplicaView.held_prefix's walk over `items` -> n, or -1. */
static Py_ssize_t prefix_keys(PyObject *blocks, PyObject *pending, PyObject *freed,
                              long long doomed, PyObject **items, Py_ssize_t total) {
    Py_ssize_t n = 0;
    for (; n < total; n++) {
        int cached = PyDict_Contains(blocks, items[n]);
        if (cached < 0) return -1;
        if (!cached) break;
    }
    if (doomed >= 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *stamp = PyDict_GetItemWithError(freed, items[i]); /* borrowed */
            if (stamp == NULL) {
                if (PyErr_Occurred()) return -1;
                continue;
            }
            long long at = PyLong_AsLongLong(stamp);
            if (at == -1 && PyErr_Occurred()) return -1;
            if (at <= doomed) return i;
        }
    }
    if (PyDict_GET_SIZE(pending)) {
        for (; n < total; n++) {
            int cached = PyDict_Contains(blocks, items[n]);
            if (cached < 0) return -1;
            if (cached) continue;
            int sent = PyDict_Contains(pending, items[n]);
            if (sent < 0) return -1;
            if (!sent) break;
        }
    }
    return n;
}

/* view_prefix(blocks, pending, freed, keys, doomed) -> n: ReplicaView.held_prefix's walk. */
static PyObject *view_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys = view_keys("view_prefix", args, nargs, 5, 3, 3);
    if (keys == NULL) return NULL;
    long long doomed = PyLong_AsLongLong(args[4]);
    Py_ssize_t n = doomed == -1 && PyErr_Occurred()
                       ? -1
                       : prefix_keys(args[0], args[1], args[2], doomed, KEYS_ITEMS(keys));
    Py_DECREF(keys);
    return view_count(n);
}

/* ---------------------------------------------------------------------------------------------
 * vLLM's exact block digests (proxy/core/hashing.py's VllmHasher.digests is the reference,
 * tests/unit/test_vllm_chain_native.py the twin tests). vLLM hashes each block as
 * H(encode((parent_digest, tuple(block_tokens), extra))): H sha256 or xxh3-128, encode pickle
 * (protocol 5) or canonical CBOR. In Python that is a tuple slice, a pickle.dumps and a hashlib
 * call per block, ~4 us; the proxy-events router spent ~14% of its samples there (round 8's
 * py-spy, bench/results/kv_events.md). Here the encoding is written byte for byte as pickle /
 * cbor2 write it for this one shape -- a bytes, a tuple of non-negative ints, and `extra`, whose
 * encoding the caller passes pre-made (hashing.py's _encoded_extras: the bytes pickle / cbor2
 * write for it at that position, checked against the reference once per namespace) -- and
 * hashed with the SHA-256 below or the vendored XXH3-128.
 * ------------------------------------------------------------------------------------------- */

/* SHA-256 from OpenSSL's libcrypto, the library hashlib.sha256 itself calls (with its
 * CPU-specific code: the SHA extensions where the CPU has them). setup.py defines
 * PROXY_HAVE_OPENSSL when libcrypto 3 links; without it vllm_chain declines the sha256
 * algorithms (returns None) and hashing.py hashes them in Python, as the reference does.
 * The digest is fetched once at import and one context is reused: the module runs under the
 * GIL, and OpenSSL 3's one-shot SHA256() fetches the algorithm on every call. */
#ifdef PROXY_HAVE_OPENSSL
#include <openssl/evp.h>
static EVP_MD *sha256_md = NULL;
static EVP_MD_CTX *sha256_ctx = NULL;

static int sha256_init(void) {
    sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
    sha256_ctx = sha256_md == NULL ? NULL : EVP_MD_CTX_new();
    return sha256_ctx != NULL;
}

/* 1 on success, 0 (with a Python exception set) when libcrypto fails. */
static int sha256(const unsigned char *data, size_t n, unsigned char out[32]) {
    unsigned int len = 0;
    if (EVP_DigestInit_ex2(sha256_ctx, sha256_md, NULL) == 1 &&
        EVP_DigestUpdate(sha256_ctx, data, n) == 1 &&
        EVP_DigestFinal_ex(sha256_ctx, out, &len) == 1 && len == 32)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "libcrypto's SHA-256 failed");
    return 0;
}
#else
static int sha256_init(void) { return 0; }
static int sha256(const unsigned char *data, size_t n, unsigned char out[32]) {
    (void)data, (void)n, (void)out;
    PyErr_SetString(PyExc_RuntimeError, "built without libcrypto");
    return 0;
}
#endif

/* Whether vllm_chain hashes the sha256 algorithms in C (set at import). */
static int sha256_in_c = 0;

/* sha256_hook(data) -> digest: vllm_chain's SHA-256, for the twin test against hashlib. */
static PyObject *sha256_hook(PyObject *self, PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "sha256_hook(data: bytes)");
        return NULL;
    }
    unsigned char out[32];
    if (!sha256_in_c) {
        PyErr_SetString(PyExc_RuntimeError, "built without libcrypto");
        return NULL;
    }
    if (!sha256((const unsigned char *)PyBytes_AS_STRING(arg), (size_t)PyBytes_GET_SIZE(arg),
                out))
        return NULL;
    return PyBytes_FromStringAndSize((const char *)out, 32);
}

/* hashing.py's VLLM_HASH_ALGOS order. */
enum { ALGO_SHA256_PICKLE, ALGO_SHA256_CBOR, ALGO_XXH_PICKLE, ALGO_XXH_CBOR, ALGO_COUNT };

/* One int as pickle (protocol >= 2) writes a non-negative int: BININT1 / BININT2 / BININT, or
 * LONG1 with its little-endian two's complement bytes ((bits >> 3) + 1 of them). */
static size_t pickle_uint(unsigned char *p, uint64_t v) {
    if (v <= 0xff) {
        p[0] = 'K', p[1] = (unsigned char)v;
        return 2;
    }
    if (v <= 0xffff) {
        p[0] = 'M', p[1] = (unsigned char)v, p[2] = (unsigned char)(v >> 8);
        return 3;
    }
    if (v <= 0x7fffffff) {
        p[0] = 'J';
        for (int i = 0; i < 4; i++) p[1 + i] = (unsigned char)(v >> (8 * i));
        return 5;
    }
    int bits = 64;
    while (!(v >> (bits - 1))) bits--;
    int nbytes = (bits >> 3) + 1;
    p[0] = 0x8a, p[1] = (unsigned char)nbytes;
    for (int i = 0; i < nbytes; i++) p[2 + i] = i < 8 ? (unsigned char)(v >> (8 * i)) : 0;
    return 2 + (size_t)nbytes;
}

/* A CBOR head (major type, argument) in its shortest form, as cbor2 writes it. */
static size_t cbor_head(unsigned char *p, unsigned major, uint64_t v) {
    unsigned char m = (unsigned char)(major << 5);
    if (v < 24) {
        p[0] = m | (unsigned char)v;
        return 1;
    }
    int n = v <= 0xff ? 1 : v <= 0xffff ? 2 : v <= 0xffffffffULL ? 4 : 8;
    p[0] = m | (unsigned char)(n == 1 ? 24 : n == 2 ? 25 : n == 4 ? 26 : 27);
    for (int i = 0; i < n; i++) p[1 + i] = (unsigned char)(v >> (8 * (n - 1 - i)));
    return 1 + (size_t)n;
}

/* Encode (parent, tuple(ids), extra) into out; returns its length. out has room for
 * 32 + parent + 11 * count + extra bytes (the longest int is LONG1's 11 bytes). */
static size_t vllm_encode(int algo, unsigned char *out, const unsigned char *parent,
                          Py_ssize_t parent_len, const uint64_t *ids, Py_ssize_t count,
                          const unsigned char *extra, Py_ssize_t extra_len) {
    unsigned char *p = out;
    if (algo == ALGO_SHA256_CBOR || algo == ALGO_XXH_CBOR) {
        *p++ = 0x83; /* an array of 3 */
        p += cbor_head(p, 2, (uint64_t)parent_len);
        memcpy(p, parent, (size_t)parent_len);
        p += parent_len;
        p += cbor_head(p, 4, (uint64_t)count);
        for (Py_ssize_t i = 0; i < count; i++) p += cbor_head(p, 0, ids[i]);
        memcpy(p, extra, (size_t)extra_len);
        return (size_t)(p - out) + (size_t)extra_len;
    }
    /* PROTO 5, FRAME <length>, SHORT_BINBYTES parent MEMOIZE, the ids' tuple MEMOIZE, extra,
     * TUPLE3 MEMOIZE STOP. */
    p[0] = 0x80, p[1] = 5, p[2] = 0x95;
    p += 11;
    p[0] = 'C', p[1] = (unsigned char)parent_len;
    memcpy(p + 2, parent, (size_t)parent_len);
    p += 2 + parent_len;
    *p++ = 0x94;
    if (count > 3) *p++ = '(';
    for (Py_ssize_t i = 0; i < count; i++) p += pickle_uint(p, ids[i]);
    *p++ = count == 1 ? 0x85 : count == 2 ? 0x86 : count == 3 ? 0x87 : 't';
    *p++ = 0x94;
    memcpy(p, extra, (size_t)extra_len);
    p += extra_len;
    p[0] = 0x87, p[1] = 0x94, p[2] = '.';
    p += 3;
    uint64_t frame = (uint64_t)(p - out) - 11;
    for (int i = 0; i < 8; i++) out[3 + i] = (unsigned char)(frame >> (8 * i));
    return (size_t)(p - out);
}

/* The ids of `tokens` as uint64: an array's buffer of 4- or 8-byte unsigned ids, or a list /
 * tuple of exact ints >= 0 that fit 64 bits. 0 done, 1 not such a sequence (the caller runs the
 * reference), -1 error. *ids is PyMem_Malloc'ed on 0. */
static int vllm_ids(PyObject *tokens, uint64_t **ids, Py_ssize_t *count) {
    if (PyObject_TypeCheck(tokens, (PyTypeObject *)array_type)) {
        Py_buffer view;
        if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
        const char *f = view.format ? view.format : "B";
        int width = (strcmp(f, "I") == 0 && view.itemsize == 4) ? 4
                    : ((strcmp(f, "L") == 0 || strcmp(f, "Q") == 0) && view.itemsize == 8) ? 8
                                                                                          : 0;
        if (width == 0) {
            PyBuffer_Release(&view);
            return 1;
        }
        Py_ssize_t n = view.len / width;
        *ids = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
        if (*ids == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (width == 4) {
                uint32_t v;
                memcpy(&v, (const char *)view.buf + 4 * i, 4);
                (*ids)[i] = v;
            } else {
                memcpy(&(*ids)[i], (const char *)view.buf + 8 * i, 8);
            }
        }
        PyBuffer_Release(&view);
        *count = n;
        return 0;
    }
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) return 1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    *ids = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (*ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v;
        /* Exact ints only: a bool or an int subclass pickles differently. */
        if (!PyLong_CheckExact(items[i]) ||
            ((v = PyLong_AsUnsignedLongLong(items[i])) == (unsigned long long)-1 &&
             PyErr_Occurred())) {
            PyErr_Clear();
            PyMem_Free(*ids);
            *ids = NULL;
            return 1;
        }
        (*ids)[i] = v;
    }
    *count = n;
    return 0;
}

/* vllm_chain(algo, parent, tokens, start, stop, block_size, first_extra, extra)
 *   -> [(event key, digest)] for blocks start..stop-1, or None (tokens the reference must take).
 * Block i's parent is block i-1's digest (`parent` for block start); block 0 is encoded with
 * `first_extra`, every other one with `extra` (pre-encoded, see above). */
static PyObject *vllm_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "vllm_chain takes 8 arguments");
        return NULL;
    }
    long algo = PyLong_AsLong(args[0]);
    if (algo == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[3]), stop = PyLong_AsSsize_t(args[4]);
    Py_ssize_t bs = PyLong_AsSsize_t(args[5]);
    if ((start == -1 || stop == -1 || bs == -1) && PyErr_Occurred()) return NULL;
    if (algo < 0 || algo >= ALGO_COUNT) {
        PyErr_SetString(PyExc_ValueError, "unknown vLLM hash algorithm");
        return NULL;
    }
    if (!PyBytes_Check(args[1]) || !PyBytes_Check(args[6]) || !PyBytes_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError, "parent and the extras must be bytes");
        return NULL;
    }
    Py_ssize_t parent_len = PyBytes_GET_SIZE(args[1]);
    int xxh = algo == ALGO_XXH_PICKLE || algo == ALGO_XXH_CBOR;
    if (!xxh && !sha256_in_c) Py_RETURN_NONE; /* no libcrypto: the reference hashes */
    Py_ssize_t digest_len = xxh ? 16 : 32;
    /* A digest this function makes, or the chain's root (a digest too): SHORT_BINBYTES and a
     * one-byte CBOR length hold it; anything longer is not a vLLM digest. */
    if (parent_len > 255 || bs < 1 || start < 0 || stop < start) {
        PyErr_SetString(PyExc_ValueError, "vllm_chain: bad parent, block size or range");
        return NULL;
    }
    uint64_t *ids = NULL;
    Py_ssize_t count = 0;
    int got = vllm_ids(args[2], &ids, &count);
    if (got < 0) return NULL;
    if (got > 0) Py_RETURN_NONE;
    if (stop > count / bs) {
        PyMem_Free(ids);
        PyErr_SetString(PyExc_ValueError, "vllm_chain: stop is past the last full block");
        return NULL;
    }
    Py_ssize_t extra_len = PyBytes_GET_SIZE(args[6]) > PyBytes_GET_SIZE(args[7])
                               ? PyBytes_GET_SIZE(args[6])
                               : PyBytes_GET_SIZE(args[7]);
    size_t room = 32 + 255 + 11 * (size_t)bs + (size_t)extra_len;
    unsigned char *buf = PyMem_Malloc(room);
    PyObject *out = PyList_New(stop - start);
    if (buf == NULL || out == NULL) {
        PyMem_Free(ids);
        PyMem_Free(buf);
        Py_XDECREF(out);
        return buf == NULL ? PyErr_NoMemory() : NULL;
    }
    unsigned char digest[32];
    const unsigned char *parent = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    for (Py_ssize_t i = start; i < stop; i++) {
        PyObject *extra = i == 0 ? args[6] : args[7];
        size_t n = vllm_encode((int)algo, buf, parent, parent_len, ids + i * bs, bs,
                               (const unsigned char *)PyBytes_AS_STRING(extra),
                               PyBytes_GET_SIZE(extra));
        if (xxh) {
            XXH128_canonical_t c;
            XXH128_canonicalFromHash(&c, XXH3_128bits(buf, n));
            memcpy(digest, c.digest, 16);
        } else if (!sha256(buf, n, digest)) {
            PyMem_Free(ids);
            PyMem_Free(buf);
            Py_DECREF(out);
            return NULL;
        }
        uint64_t key = 0;
        for (Py_ssize_t j = digest_len - 8; j < digest_len; j++) key = key << 8 | digest[j];
        PyObject *d = PyBytes_FromStringAndSize((const char *)digest, digest_len);
        PyObject *k = d == NULL ? NULL : PyLong_FromUnsignedLongLong(key);
        PyObject *entry = k == NULL ? NULL : PyTuple_Pack(2, k, d);
        Py_XDECREF(k);
        Py_XDECREF(d);
        if (entry == NULL) {
            PyMem_Free(ids);
            PyMem_Free(buf);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i - start, entry);
        parent = (const unsigned char *)PyBytes_AS_STRING(d);
        parent_len = digest_len;
    }
    PyMem_Free(ids);
    PyMem_Free(buf);
    return out;
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
    {"route_tokens", (PyCFunction)(void (*)(void))route_tokens, METH_FASTCALL,
     "route_tokens(index, policy, kind, tokens, block_size, seed, loads, capacity, decision) "
     "-> Decision or None: Router.route's token-id case"},
    {"learn_tokens", (PyCFunction)(void (*)(void))learn_tokens, METH_FASTCALL,
     "learn_tokens(index, tokens, completion, block_size, blocks, replica) -> True or None: "
     "Router.record_completion's token-id case"},
    {"view_store", (PyCFunction)(void (*)(void))view_store, METH_FASTCALL,
     "view_store(blocks, pending, freed, pins, tick, keys) -> confirmed: kv_view._store"},
    {"view_remove", (PyCFunction)(void (*)(void))view_remove, METH_FASTCALL,
     "view_remove(blocks, pending, freed, keys) -> confirmed: kv_view._remove"},
    {"view_hold", (PyCFunction)(void (*)(void))view_hold, METH_FASTCALL,
     "view_hold(pins, freed, blocks, keys) -> new: kv_view._hold"},
    {"view_release", (PyCFunction)(void (*)(void))view_release, METH_FASTCALL,
     "view_release(pins, freed, blocks, tick, keys): kv_view._release"},
    {"view_expect", (PyCFunction)(void (*)(void))view_expect, METH_FASTCALL,
     "view_expect(blocks, pending, keys, deadline): kv_view._expect"},
    {"view_apply", (PyCFunction)(void (*)(void))view_apply, METH_FASTCALL,
     "view_apply(blocks, pending, freed, pins, tick, events, start) -> (confirmed, stop): "
     "kv_view._apply"},
    {"view_prefix", (PyCFunction)(void (*)(void))view_prefix, METH_FASTCALL,
     "view_prefix(blocks, pending, freed, keys, doomed) -> n: kv_view._prefix"},
    {"sha256_hook", sha256_hook, METH_O,
     "sha256_hook(data) -> vllm_chain's sha256 digest (the twin test's hook)"},
    {"vllm_chain", (PyCFunction)(void (*)(void))vllm_chain, METH_FASTCALL,
     "vllm_chain(algo, parent, tokens, start, stop, block_size, first_extra, extra) -> "
     "[(event key, digest)] or None: VllmHasher.digests"},
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
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_young, "_young"}, {&s_old, "_old"}, {&s_half, "_half"}, {&s_evictions, "evictions"},
        {&s_max_replicas, "max_replicas"}, {&s_concurrency, "concurrency"}, {&s_turn, "_turn"},
        {&s_model, "model"}, {&s_prefill, "prefill_s_per_token"},
        {&s_decode_seq, "decode_s_per_seq_step"}, {&s_output, "expected_output_tokens"},
        {&s_step_base, "decode_step_base_s"}, {&s_imbalance, "imbalance"},
        {&s_replica, "replica"}, {&s_outcome, "outcome"}, {&s_matched_blocks, "matched_blocks"},
        {&s_blocks, "blocks"}, {&s_affinity, "affinity"}, {&s_spilled, "spilled"},
        {&s_unmatched, "unmatched"}, {&s_kind, "kind"}, {&s_keys, "keys"},
        {&s_block_stored, "BlockStored"}, {&s_block_removed, "BlockRemoved"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL) return NULL;
    }
    empty_tuple = PyTuple_New(0);
    if (empty_tuple == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    sha256_in_c = sha256_init();
    /* Whether vllm_chain hashes the sha256 algorithms in C (libcrypto linked and working). */
    if (PyModule_AddIntConstant(m, "SHA256_IN_C", sha256_in_c) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "CONCURRENCY_MEMORY_DECISIONS",
                                CONCURRENCY_MEMORY_DECISIONS) < 0 ||
        PyModule_AddStringConstant(m, "XXHASH_VERSION", "0.8.2") < 0) {
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
