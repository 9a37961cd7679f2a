/* rendezvous._quickstore: the store server's read path for the frames that dominate a
 * rendezvous, in C.
 *
 * Owns: `read_quick(conn, ctx)`, which does one non-blocking recv() on an authenticated,
 * plain (not multiplexed) connection with nothing buffered either way, executes the complete
 * VALIDATE (the handshake: torch's magic, first; it sets `conn.validated`), PING, GET, SET,
 * ADD, and WAIT / CHECK of keys that are all present at the front of what arrived against the
 * `MemoryStore`'s dict, and sends their replies in one send().
 * Everything it does not take (another op, a frame cut by the read, a length over a limit, the
 * auth key, a write to a key somebody waits on, an ADD to a value that is not a plain decimal,
 * a WAIT that must wait, a first frame that is not a VALIDATE with the magic) it hands back untouched, from that frame on, to the Python path
 * (`rendezvous.server`), which decides exactly as it always did: this module only ever does a
 * subset of what `StoreServer._quick` / `_handle` do, with the same results.
 *
 * Atomicity: it runs with the GIL held from the recv to the send and calls no Python code that
 * could release it (dict operations on bytes keys, the lock's `locked()`), so no other thread
 * runs while it touches the table. It executes nothing while another thread holds the
 * table's lock (a LocalKV write in the middle of its read-modify-write): then all of the read
 * goes to the Python path, which takes the lock.
 *
 * ctx: a tuple made once per server, (data: dict, waiters: dict, barriers: dict, lock,
 * max_key: int, max_value: int, auth_key: bytes, budget: int).
 *
 * Returns None (nothing to read), False (EOF or a socket error: close the connection), an int n
 * (n requests executed, all of the read consumed, every reply sent) or a tuple
 * (n, unsent_replies: bytes, rest: bytes): the replies of the n executed requests not yet sent,
 * and the unread part of the read (from the first frame not executed) for the Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#define READ_SIZE (64 * 1024) /* protocol.READ_SIZE */
#define MAX_KEYS 16           /* keys of one WAIT / CHECK taken here (more: the Python path) */

enum { OP_VALIDATE = 0, OP_SET = 1, OP_GET = 3, OP_ADD = 4, OP_CHECK = 5, OP_WAIT = 6, OP_PING = 13 };
#define VALIDATION_MAGIC 0x3C85F7CEu /* protocol.VALIDATION_MAGIC */

/* One buffer for every server of the process: used only with the GIL held, never across a
 * call that could release it. */
static char rbuf[READ_SIZE];
static PyObject *str_locked, *str_fd, *str_validated;

typedef struct {
    char *p;
    size_t len, cap;
    char small[4096];
} Out;

static int out_put(Out *o, const void *src, size_t n) {
    if (o->len + n > o->cap) {
        size_t cap = o->cap * 2;
        while (cap < o->len + n) cap *= 2;
        char *p = o->p == o->small ? PyMem_Malloc(cap) : PyMem_Realloc(o->p, cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (o->p == o->small) memcpy(p, o->small, o->len);
        o->p = p;
        o->cap = cap;
    }
    memcpy(o->p + o->len, src, n);
    o->len += n;
    return 0;
}

static void out_free(Out *o) {
    if (o->p != o->small) PyMem_Free(o->p);
}

static uint64_t rd_u64(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* native little-endian, as torch's client writes it */
    return v;
}

typedef struct {
    PyObject *data, *waiters, *barriers, *auth_key;
    uint64_t max_key, max_value;
} Table;

/* 1 when a write to `key` must go through the Python path (it wakes waiters), 0 if not,
 * -1 on error. */
static int watched(const Table *t, PyObject *key) {
    int r = PyDict_Contains(t->waiters, key);
    if (r != 0) return r;
    return PyDict_Contains(t->barriers, key);
}

/* A plain decimal integer (what ADD stores: str(int)) that fits with room for an add;
 * 0 otherwise (the Python path decides: it accepts more spellings or drops the connection). */
static int plain_decimal(PyObject *v, long long *out) {
    const char *s = PyBytes_AS_STRING(v);
    Py_ssize_t n = PyBytes_GET_SIZE(v), i = 0;
    int neg = 0;
    if (n > 0 && s[0] == '-') {
        neg = 1;
        i = 1;
    }
    if (i == n || n - i > 18) return 0;
    long long x = 0;
    for (; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return 0;
        x = x * 10 + (s[i] - '0');
    }
    *out = neg ? -x : x;
    return 1;
}

/* Execute the frame at buf[pos:n]. Returns its end (> pos) when executed, 0 when the Python
 * path must take it, -1 on error (exception set). */
static Py_ssize_t one(const Table *t, const char *buf, size_t pos, size_t n, Out *o) {
    if (pos + 5 <= n && (unsigned char)buf[pos] == OP_PING) { /* u32 nonce, echoed */
        if (out_put(o, buf + pos + 1, 4) < 0) return -1;
        return (Py_ssize_t)(pos + 5);
    }
    if (pos + 9 > n) return 0;
    int op = (unsigned char)buf[pos];
    if (op == OP_WAIT || op == OP_CHECK) {
        uint64_t count = rd_u64(buf + pos + 1);
        if (count < 1 || count > MAX_KEYS) return 0;
        size_t p = pos + 9;
        for (uint64_t i = 0; i < count; i++) { /* the whole frame first: all keys complete */
            if (p + 8 > n) return 0;
            uint64_t kl = rd_u64(buf + p);
            if (kl > t->max_key || kl > n - p - 8) return 0;
            p += 8 + kl;
        }
        size_t q = pos + 9;
        for (uint64_t i = 0; i < count; i++) {
            uint64_t kl = rd_u64(buf + q);
            PyObject *key = PyBytes_FromStringAndSize(buf + q + 8, (Py_ssize_t)kl);
            if (key == NULL) return -1;
            int r = PyDict_Contains(t->data, key);
            Py_DECREF(key);
            if (r < 0) return -1;
            if (r == 0) return 0; /* WAIT registers a waiter, CHECK looks at queues: Python */
            q += 8 + kl;
        }
        const char ready = 0; /* STOP_WAITING / READY */
        if (out_put(o, &ready, 1) < 0) return -1;
        return (Py_ssize_t)p;
    }
    if (op != OP_SET && op != OP_GET && op != OP_ADD) return 0;
    uint64_t kl = rd_u64(buf + pos + 1);
    size_t s = pos + 9;
    if (kl > t->max_key || kl > n - s) return 0;
    size_t e = s + kl;
    if (op == OP_GET) {
        PyObject *key = PyBytes_FromStringAndSize(buf + s, (Py_ssize_t)kl);
        if (key == NULL) return -1;
        PyObject *v = PyDict_GetItemWithError(t->data, key); /* borrowed */
        Py_DECREF(key);
        if (v == NULL && PyErr_Occurred()) return -1;
        if (v != NULL && !PyBytes_Check(v)) return 0;
        uint64_t vl = v == NULL ? 0 : (uint64_t)PyBytes_GET_SIZE(v);
        if (out_put(o, &vl, 8) < 0) return -1;
        if (vl && out_put(o, PyBytes_AS_STRING(v), vl) < 0) return -1;
        return (Py_ssize_t)e;
    }
    if (e + 8 > n) return 0;
    size_t end;
    uint64_t vl = 0;
    if (op == OP_SET) {
        vl = rd_u64(buf + e);
        if (vl > t->max_value || vl > n - e - 8) return 0;
        end = e + 8 + vl;
        if ((Py_ssize_t)kl == PyBytes_GET_SIZE(t->auth_key) &&
            memcmp(buf + s, PyBytes_AS_STRING(t->auth_key), kl) == 0)
            return 0;
    } else {
        end = e + 8;
    }
    PyObject *key = PyBytes_FromStringAndSize(buf + s, (Py_ssize_t)kl);
    if (key == NULL) return -1;
    int w = watched(t, key);
    if (w != 0) {
        Py_DECREF(key);
        return w < 0 ? -1 : 0;
    }
    PyObject *value;
    if (op == OP_SET) {
        value = PyBytes_FromStringAndSize(buf + e + 8, (Py_ssize_t)vl);
    } else {
        int64_t amount;
        memcpy(&amount, buf + e, 8);
        long long old = 0, sum;
        PyObject *cur = PyDict_GetItemWithError(t->data, key); /* borrowed */
        if (cur == NULL && PyErr_Occurred()) {
            Py_DECREF(key);
            return -1;
        }
        if (cur != NULL && (!PyBytes_Check(cur) || !plain_decimal(cur, &old))) {
            Py_DECREF(key);
            return 0;
        }
        if (__builtin_add_overflow(old, (long long)amount, &sum)) {
            Py_DECREF(key);
            return 0;
        }
        char text[24];
        int tl = snprintf(text, sizeof text, "%lld", sum);
        value = PyBytes_FromStringAndSize(text, tl);
        int64_t reply = sum;
        if (value != NULL && out_put(o, &reply, 8) < 0) {
            Py_DECREF(value);
            value = NULL;
        }
    }
    if (value == NULL) {
        Py_DECREF(key);
        return -1;
    }
    int r = PyDict_SetItem(t->data, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
    return r < 0 ? -1 : (Py_ssize_t)end;
}

static PyObject *read_quick(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 8) {
        PyErr_SetString(PyExc_TypeError, "read_quick(conn, ctx): ctx is an 8-tuple");
        return NULL;
    }
    PyObject *conn = args[0];
    PyObject *fdo = PyObject_GetAttr(conn, str_fd);
    if (fdo == NULL) return NULL;
    long fdl = PyLong_AsLong(fdo);
    Py_DECREF(fdo);
    if (fdl == -1 && PyErr_Occurred()) return NULL;
    int fd = (int)fdl;
    PyObject *vo = PyObject_GetAttr(conn, str_validated);
    if (vo == NULL) return NULL;
    int validated = PyObject_IsTrue(vo);
    Py_DECREF(vo);
    if (validated < 0) return NULL;
    PyObject *ctx = args[1];
    Table t = {PyTuple_GET_ITEM(ctx, 0), PyTuple_GET_ITEM(ctx, 1), PyTuple_GET_ITEM(ctx, 2),
               PyTuple_GET_ITEM(ctx, 6), 0, 0};
    PyObject *lock = PyTuple_GET_ITEM(ctx, 3);
    if (!PyDict_CheckExact(t.data) || !PyDict_CheckExact(t.waiters) ||
        !PyDict_CheckExact(t.barriers) || !PyBytes_Check(t.auth_key)) {
        PyErr_SetString(PyExc_TypeError, "read_quick: ctx = (dict, dict, dict, lock, int, int, bytes, int)");
        return NULL;
    }
    t.max_key = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ctx, 4));
    t.max_value = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ctx, 5));
    long budget = PyLong_AsLong(PyTuple_GET_ITEM(ctx, 7));
    if (PyErr_Occurred()) return NULL;

    ssize_t got = recv(fd, rbuf, READ_SIZE, MSG_DONTWAIT);
    if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) Py_RETURN_NONE;
        Py_RETURN_FALSE;
    }
    if (got == 0) Py_RETURN_FALSE;
    size_t n = (size_t)got, pos = 0;
    long count = 0;
    Out o;
    o.p = o.small;
    o.len = 0;
    o.cap = sizeof o.small;

    PyObject *held = PyObject_CallMethodNoArgs(lock, str_locked);
    if (held == NULL) goto error;
    int busy = PyObject_IsTrue(held);
    Py_DECREF(held);
    if (busy < 0) goto error;
    if (!busy && !validated) { /* the handshake: VALIDATE with the magic comes first */
        uint32_t magic = 0;
        if (n >= 5) memcpy(&magic, rbuf + 1, 4);
        if (n >= 5 && rbuf[0] == OP_VALIDATE && magic == VALIDATION_MAGIC) {
            if (PyObject_SetAttr(conn, str_validated, Py_True) < 0) goto error;
            validated = 1;
            pos = 5;
            count = 1;
        }
    }
    if (!busy && validated) {
        while (pos < n && count < budget) {
            Py_ssize_t end = one(&t, rbuf, pos, n, &o);
            if (end < 0) goto error;
            if (end == 0) break;
            pos = (size_t)end;
            count++;
        }
    }
    size_t sent = 0;
    if (pos == n && o.len) {
        ssize_t r = send(fd, o.p, o.len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r > 0) sent = (size_t)r; /* an error: the Python path's flush sees it and closes */
    }
    PyObject *result;
    if (pos == n && sent == o.len) {
        result = PyLong_FromLong(count);
    } else {
        result = Py_BuildValue("(ly#y#)", count, o.p + sent, (Py_ssize_t)(o.len - sent),
                               rbuf + pos, (Py_ssize_t)(n - pos));
    }
    out_free(&o);
    return result;
error:
    out_free(&o);
    return NULL;
}

static PyMethodDef methods[] = {
    {"read_quick", (PyCFunction)(void (*)(void))read_quick, METH_FASTCALL,
     "read_quick(conn, ctx) -> None | False | int | (int, bytes, bytes); see the module doc."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "rendezvous._quickstore",
    "The store server's read path for VALIDATE, PING, GET, SET, ADD, WAIT and CHECK, in C.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__quickstore(void) {
    str_locked = PyUnicode_InternFromString("locked");
    str_fd = PyUnicode_InternFromString("fd");
    str_validated = PyUnicode_InternFromString("validated");
    if (str_locked == NULL || str_fd == NULL || str_validated == NULL) return NULL;
    return PyModule_Create(&module);
}
