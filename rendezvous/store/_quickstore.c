/* rendezvous.store._quickstore: the store server's read path for the frames that dominate a
 * rendezvous, in C.
 *
 * Owns: `read_quick(conn, ctx)`, which does one non-blocking recv() on an authenticated
 * connection with nothing buffered either way and (a plain one) no waiter, executes
 * the complete frames at the front of what arrived against the `MemoryStore`'s dicts --
 * VALIDATE (the handshake: torch's magic, first; it sets `conn.validated`), PING, GET, SET,
 * ADD, WAIT / CHECK of keys that are all present, and a one-key WAIT of an absent key (it
 * registers the waiter as `StoreServer._wait_keys` does, and is the read's last frame) -- and
 * sends their replies in one send(). A SET or ADD of a key somebody waits on does what
 * `MemoryStore._changed` does for plain waiters; once the lock is released the satisfied ones
 * are answered: STOP_WAITING sent here to a plain connection of this server with nothing
 * queued, `fire()` (the Python delivery) for every other.
 * Everything it does not take (another op, a frame cut by the read, a length over a limit, the
 * auth key, a BARRIER's counter, an ADD to a value that is not a plain decimal, a multi-key
 * WAIT that must wait, a key that names a queue, a first frame that is not a VALIDATE with
 * the magic) it hands back untouched, from that frame on, to the Python path
 * (`rendezvous.store.server`), which decides exactly as it always did: this module only ever does a
 * subset of what `StoreServer._quick` / `_handle` do, with the same results.
 *
 * A multiplexed connection (a node proxy's link, `conn.mux`): each frame is `u32 tag` + one of
 * the frames above (not the handshake) or a MULTI_SET (what a proxy's round of SETs becomes;
 * not with the auth key or a BARRIER's counter); a reply carries its tag, a frame without a
 * reply (SET, MULTI_SET, a WAIT that waits) sends nothing, a WAIT that waits registers its
 * waiter under its tag (`conn.mux_waiters`, as `StoreServer._registered` does) and the frames
 * behind it go on (they are independent); a CANCEL_WAIT, like any other frame, goes to the
 * Python path. Replies this read could not send are queued on `conn.out` before any waiter is
 * answered (one this read satisfied may belong to the same connection), and the tuple then
 * says nothing is unsent.
 *
 * Atomicity: it takes the table's lock without blocking for the whole execution (when another
 * thread holds it -- a LocalKV write in its read-modify-write -- all of the read goes to the
 * Python path, which waits for the lock), so no other thread touches the table even while a
 * waiter's constructor runs Python code. Waiters are answered after the lock is released, as
 * `MemoryStore` fires them.
 *
 * ctx: a tuple made once per server, (data: dict, waiters: dict, barriers: dict, lock,
 * max_key: int, max_value: int, auth_key: bytes, budget: int, queues: dict, Waiter, _Wake,
 * server, max_keys_per_request).
 *
 * Returns None (nothing to read), False (EOF or a socket error: close the connection), an int n
 * (n requests executed, all of the read consumed, every reply sent) or a tuple
 * (n, unsent_replies: bytes, rest: bytes): the replies of the n executed requests not yet sent,
 * and the unread part of the read (from the first frame not executed) for the Python path.
 *
 * Also owns, for the node proxy (`rendezvous.store.proxy`): `proxy_read(conn, ctx)`, one recv() on a
 * validated local connection with nothing buffered, whose complete SET (not the auth key),
 * GET, ADD and WAIT / CHECK frames it queues onto the proxy's batch exactly as
 * `StoreProxy._handle` does (a `protocol.Request`, a reply slot on `conn.slots` for all but
 * SET); ctx = (batch: list, Request, auth_key, max_key, max_value, budget); it returns None,
 * False, n, or (n, rest) as above, without replies (the proxy answers after its upstream
 * round). And, for both: `flush_out(conns)`, what `LoopServer._flush` does for a list of
 * connections, returning the ones it leaves to the Python flush (a short send, ...); and
 * `loop_turn(epfd, conns, ctx, timeout, proxy, until, owner, hold, accept)`, the loop's
 * epoll_wait with the GIL released plus the reads `_read` would give to `read_quick` (or,
 * for the proxy, to `proxy_read`), turning again while a turn leaves nothing to Python (see
 * the function), and returning the events and results the Python loop finishes; given the listening socket,
 * it also accepts new connections (`accept_some`: accept4, TCP_NODELAY, and the Python
 * `LoopServer._adopt` per connection, which makes and registers the connection object), so a
 * burst of connects does not leave the C loop once per turn for Python's `_accept`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <math.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define READ_SIZE (64 * 1024) /* protocol.READ_SIZE */
#define CAPS_NONCE 0x46544350u /* protocol.CAPS_NONCE */
#define MAX_KEYS 16           /* keys of one WAIT / CHECK taken here (more: the Python path) */

enum { OP_VALIDATE = 0, OP_SET = 1, OP_GET = 3, OP_ADD = 4, OP_CHECK = 5, OP_WAIT = 6,
       OP_MULTI_SET = 11, OP_PING = 13 };
#define VALIDATION_MAGIC 0x3C85F7CEu /* protocol.VALIDATION_MAGIC */

#define CTX_SIZE 13
#define PCTX_SIZE 6 /* proxy_read's ctx */
#define TURN_EVENTS 1023 /* events one loop_turn takes, as select.epoll.poll() */

static PyObject *str_acquire, *str_release, *str_fd, *str_validated, *str_done, *str_remaining,
    *str_waiter, *str_fire, *str_srv, *str_c, *str_tag, *str_closed, *str_out, *str_want_write,
    *str_slots, *str_append, *str_out_bytes, *str_authed, *str_mux, *str_buf, *str_mux_waiters,
    *str_dirty, *str_backlog, *str_batch_since, *zero;

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
    PyObject *data, *waiters, *barriers, *queues, *auth_key;
    PyObject *waiter_type, *wake_type, *srv; /* memory.Waiter, server._Wake, the server */
    PyObject *conn;                          /* the connection being read */
    PyObject *fired;                         /* waiters this read satisfied (a list) */
    int registered;                          /* this read's WAIT registered a waiter */
    uint64_t max_key, max_value, max_pairs;
    int mux;                                 /* conn is multiplexed: replies carry `tag` */
    uint32_t tag;                            /* the tag of the mux frame being executed */
} Table;

/* After a write to `key` (the lock held): what `MemoryStore._changed` does for its plain
 * waiters: each loses one missing key, the ones left with none are done and go to t->fired
 * (delivered once the lock is released). 0, or -1 on error. */
static int changed(Table *t, PyObject *key) {
    PyObject *ws = PyDict_GetItemWithError(t->waiters, key); /* borrowed */
    if (ws == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(ws);
    if (PyDict_DelItem(t->waiters, key) < 0) {
        Py_DECREF(ws);
        return -1;
    }
    Py_ssize_t i = 0;
    PyObject *w, *unused;
    int rc = 0;
    while (rc == 0 && PyDict_Next(ws, &i, &w, &unused)) {
        PyObject *done = PyObject_GetAttr(w, str_done);
        if (done == NULL) { rc = -1; break; }
        int is_done = PyObject_IsTrue(done);
        Py_DECREF(done);
        if (is_done) continue;
        PyObject *rem = PyObject_GetAttr(w, str_remaining);
        if (rem == NULL) { rc = -1; break; }
        long left = PyLong_AsLong(rem) - 1;
        Py_DECREF(rem);
        if (left == -2 && PyErr_Occurred()) { rc = -1; break; }
        PyObject *lo = PyLong_FromLong(left);
        if (lo == NULL || PyObject_SetAttr(w, str_remaining, lo) < 0) {
            Py_XDECREF(lo);
            rc = -1;
            break;
        }
        Py_DECREF(lo);
        if (left <= 0 && (PyObject_SetAttr(w, str_done, Py_True) < 0 || PyList_Append(t->fired, w) < 0))
            rc = -1;
    }
    Py_DECREF(ws);
    return rc;
}

/* Register a waiter of the connection being read for `key` (absent, one key), as
 * `StoreServer._wait_keys` does: Waiter((key,), _Wake(srv, conn, -1)) indexed under the key
 * and made the connection's waiter. The lock is held. 0, or -1 on error. */
static int register_waiter(Table *t, PyObject *key) {
    PyObject *wake = NULL, *keys = NULL, *w = NULL, *ws;
    PyObject *tag = t->mux ? PyLong_FromUnsignedLong(t->tag) : PyLong_FromLong(-1);
    if (tag == NULL) return -1;
    wake = PyObject_CallFunctionObjArgs(t->wake_type, t->srv, t->conn, tag, NULL);
    if (wake == NULL) {
        Py_DECREF(tag);
        return -1;
    }
    keys = PyTuple_Pack(1, key);
    if (keys != NULL) w = PyObject_CallFunctionObjArgs(t->waiter_type, keys, wake, NULL);
    Py_XDECREF(keys);
    Py_DECREF(wake);
    if (w == NULL) {
        Py_DECREF(tag);
        return -1;
    }
    ws = PyDict_GetItemWithError(t->waiters, key); /* borrowed */
    int rc = 0;
    if (ws == NULL) {
        if (PyErr_Occurred()) {
            rc = -1;
        } else {
            PyObject *d = PyDict_New();
            rc = d == NULL || PyDict_SetItem(d, w, Py_None) < 0 || PyDict_SetItem(t->waiters, key, d) < 0 ? -1 : 0;
            Py_XDECREF(d);
        }
    } else {
        rc = PyDict_SetItem(ws, w, Py_None);
    }
    if (rc == 0 && t->mux) {
        PyObject *mw = PyObject_GetAttr(t->conn, str_mux_waiters);
        rc = mw == NULL || PyDict_SetItem(mw, tag, w) < 0 ? -1 : 0;
        Py_XDECREF(mw);
    } else if (rc == 0) {
        rc = PyObject_SetAttr(t->conn, str_waiter, w);
    }
    Py_DECREF(tag);
    Py_DECREF(w);
    if (rc == 0) t->registered = 1;
    return rc;
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

/* A MULTI_SET frame at buf[pos:n] (u64 count, then count x (key, value)), as
 * `MemoryStore.multi_set` does it: every pair set in order, each key's waiters told. Its end, 0
 * for the Python path (cut, over a limit, the auth key, a BARRIER's counter), -1 on error. */
static Py_ssize_t multi_set(Table *t, const char *buf, size_t pos, size_t n) {
    if (pos + 9 > n) return 0;
    uint64_t count = rd_u64(buf + pos + 1);
    if (count > t->max_pairs) return 0;
    size_t p = pos + 9;
    for (uint64_t i = 0; i < count; i++) { /* the whole frame first: every pair complete */
        if (p + 8 > n) return 0;
        uint64_t kl = rd_u64(buf + p);
        if (kl > t->max_key || kl > n - p - 8) return 0;
        if ((Py_ssize_t)kl == PyBytes_GET_SIZE(t->auth_key) &&
            memcmp(buf + p + 8, PyBytes_AS_STRING(t->auth_key), kl) == 0)
            return 0;
        p += 8 + kl;
        if (p + 8 > n) return 0;
        uint64_t vl = rd_u64(buf + p);
        if (vl > t->max_value || vl > n - p - 8) return 0;
        p += 8 + vl;
    }
    PyObject **keys = PyMem_Calloc(count ? count : 1, sizeof(PyObject *));
    if (keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t rc = (Py_ssize_t)p;
    size_t q = pos + 9;
    for (uint64_t i = 0; i < count && rc > 0; i++) { /* no BARRIER counter among them */
        uint64_t kl = rd_u64(buf + q);
        keys[i] = PyBytes_FromStringAndSize(buf + q + 8, (Py_ssize_t)kl);
        q += 8 + kl;
        q += 8 + rd_u64(buf + q);
        if (keys[i] == NULL) {
            rc = -1;
            break;
        }
        int b = PyDict_Contains(t->barriers, keys[i]);
        if (b != 0) rc = b < 0 ? -1 : 0;
    }
    q = pos + 9;
    for (uint64_t i = 0; i < count && rc > 0; i++) {
        q += 8 + rd_u64(buf + q);
        uint64_t vl = rd_u64(buf + q);
        PyObject *value = PyBytes_FromStringAndSize(buf + q + 8, (Py_ssize_t)vl);
        q += 8 + vl;
        if (value == NULL || PyDict_SetItem(t->data, keys[i], value) < 0 || changed(t, keys[i]) < 0)
            rc = -1;
        Py_XDECREF(value);
    }
    for (uint64_t i = 0; i < count; i++) Py_XDECREF(keys[i]);
    PyMem_Free(keys);
    return rc;
}

/* Execute the frame at buf[pos:n]. Returns its end (> pos) when executed, 0 when the Python
 * path must take it, -1 on error (exception set). */
static Py_ssize_t one(Table *t, const char *buf, size_t pos, size_t n, Out *o) {
    if (pos + 5 <= n && (unsigned char)buf[pos] == OP_PING) { /* u32 nonce, echoed */
        uint32_t nonce;
        memcpy(&nonce, buf + pos + 1, 4);
        if (nonce == CAPS_NONCE) return 0; /* the extensions asked for: `StoreServer._ping` */
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
            if (r == 0 && op == OP_WAIT && count == 1) { /* absent: wait for it, unless a queue */
                r = PyDict_Contains(t->queues, key);
                if (r == 0) {
                    r = register_waiter(t, key);
                    Py_DECREF(key);
                    return r < 0 ? -1 : (Py_ssize_t)p; /* no reply until it fires */
                }
                r = r < 0 ? -1 : 0; /* the key names a queue: Python */
            }
            Py_DECREF(key);
            if (r < 0) return -1;
            if (r == 0) return 0; /* a multi-key WAIT that must wait, CHECK (queues): Python */
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
    int w = PyDict_Contains(t->barriers, key); /* a BARRIER's counter: Python */
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
    Py_DECREF(value);
    if (r == 0) r = changed(t, key); /* wakes the key's waiters (after the lock) */
    Py_DECREF(key);
    return r < 0 ? -1 : (Py_ssize_t)end;
}

/* Answer the waiters this read satisfied, the lock released: STOP_WAITING sent at once to a
 * connection of this server with nothing queued whose waiter it still is (a plain one's
 * `waiter`, or a mux tag's in `mux_waiters`: tag + STOP_WAITING, the rest of a short send
 * queued and the connection marked for the turn's flush), what `StoreServer._deliver` +
 * `_send_now` do there; every other waiter's `fire()` (queued output, nothing sent, another
 * owner) runs as the Python path would run it. */
static int deliver(Table *t) {
    Py_ssize_t n = PyList_GET_SIZE(t->fired);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *w = PyList_GET_ITEM(t->fired, i);
        PyObject *wake = PyObject_GetAttr(w, str_fire);
        if (wake == NULL) return -1;
        int sent = 0;
        if (Py_TYPE(wake) == (PyTypeObject *)t->wake_type) {
            PyObject *srv = PyObject_GetAttr(wake, str_srv), *c = PyObject_GetAttr(wake, str_c),
                     *tag = PyObject_GetAttr(wake, str_tag);
            PyObject *cw = c ? PyObject_GetAttr(c, str_waiter) : NULL;
            PyObject *mw = NULL; /* a mux tag's: read below */
            PyObject *closed = c ? PyObject_GetAttr(c, str_closed) : NULL;
            PyObject *out = c ? PyObject_GetAttr(c, str_out) : NULL;
            PyObject *ww = c ? PyObject_GetAttr(c, str_want_write) : NULL;
            PyObject *fd = c ? PyObject_GetAttr(c, str_fd) : NULL;
            if (srv && tag && cw && closed && out && ww && fd) {
                long tg = PyLong_AsLong(tag), fdl = PyLong_AsLong(fd);
                int idle = srv == t->srv && closed == Py_False && PyList_CheckExact(out) &&
                           PyList_GET_SIZE(out) == 0 && ww == Py_False && fdl >= 0;
                if (idle && tg == -1 && cw == w) {
                    const char stop = 0; /* STOP_WAITING */
                    if (send((int)fdl, &stop, 1, MSG_DONTWAIT | MSG_NOSIGNAL) == 1) {
                        sent = PyObject_SetAttr(c, str_waiter, Py_None) < 0 ? -1 : 1;
                    }
                } else if (idle && tg >= 0 && (mw = PyObject_GetAttr(c, str_mux_waiters)) != NULL &&
                           PyDict_CheckExact(mw) && PyDict_GetItemWithError(mw, tag) == w) {
                    /* a mux tag's waiter */
                    char frame[5]; /* u32 tag + STOP_WAITING */
                    uint32_t t32 = (uint32_t)tg;
                    memcpy(frame, &t32, 4);
                    frame[4] = 0;
                    ssize_t r = send((int)fdl, frame, 5, MSG_DONTWAIT | MSG_NOSIGNAL);
                    if (r > 0 && r < 5) { /* the rest queued, flushed at the turn's end */
                        PyObject *rest = PyBytes_FromStringAndSize(frame + r, 5 - r);
                        PyObject *ob = rest ? PyObject_GetAttr(c, str_out_bytes) : NULL;
                        PyObject *more = ob ? PyLong_FromSsize_t(PyLong_AsSsize_t(ob) + 5 - r) : NULL;
                        PyObject *dirty = more ? PyObject_GetAttr(srv, str_dirty) : NULL;
                        if (dirty == NULL || PyList_Append(out, rest) < 0 ||
                            PyObject_SetAttr(c, str_out_bytes, more) < 0 || PyList_Append(dirty, c) < 0)
                            sent = -1;
                        Py_XDECREF(rest); Py_XDECREF(ob); Py_XDECREF(more); Py_XDECREF(dirty);
                    }
                    if (r > 0 && sent == 0) sent = PyDict_DelItem(mw, tag) < 0 ? -1 : 1;
                }
            }
            Py_XDECREF(srv); Py_XDECREF(c); Py_XDECREF(tag); Py_XDECREF(cw); Py_XDECREF(mw);
            Py_XDECREF(closed); Py_XDECREF(out); Py_XDECREF(ww); Py_XDECREF(fd);
            if (PyErr_Occurred()) sent = -1;
        }
        if (sent == 0) {
            PyObject *r = PyObject_CallNoArgs(wake);
            Py_XDECREF(r);
            if (r == NULL) sent = -1;
        }
        Py_DECREF(wake);
        if (sent < 0) return -1;
    }
    return 0;
}

/* conn.fd as an int, or -1 with an exception set. */
static int conn_fd(PyObject *conn) {
    PyObject *fdo = PyObject_GetAttr(conn, str_fd);
    if (fdo == NULL) return -1;
    long fd = PyLong_AsLong(fdo);
    Py_DECREF(fdo);
    return fd == -1 && PyErr_Occurred() ? -1 : (int)fd;
}

static PyObject *quick(PyObject *conn, PyObject *ctx);
static int attr_true(PyObject *o, PyObject *name);

static PyObject *read_quick(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != CTX_SIZE) {
        PyErr_SetString(PyExc_TypeError, "read_quick(conn, ctx): ctx is a 12-tuple");
        return NULL;
    }
    return quick(args[0], args[1]);
}

static PyObject *quick(PyObject *conn, PyObject *ctx) {
    int fd = conn_fd(conn);
    if (fd < 0) return NULL;
    PyObject *vo = PyObject_GetAttr(conn, str_validated);
    if (vo == NULL) return NULL;
    int validated = PyObject_IsTrue(vo);
    Py_DECREF(vo);
    if (validated < 0) return NULL;
    int mux = attr_true(conn, str_mux);
    if (mux < 0) return NULL;
    Table t = {PyTuple_GET_ITEM(ctx, 0), PyTuple_GET_ITEM(ctx, 1), PyTuple_GET_ITEM(ctx, 2),
               PyTuple_GET_ITEM(ctx, 8), PyTuple_GET_ITEM(ctx, 6), PyTuple_GET_ITEM(ctx, 9),
               PyTuple_GET_ITEM(ctx, 10), PyTuple_GET_ITEM(ctx, 11), conn, NULL, 0, 0, 0, 0, 0, 0};
    PyObject *lock = PyTuple_GET_ITEM(ctx, 3);
    if (!PyDict_CheckExact(t.data) || !PyDict_CheckExact(t.waiters) ||
        !PyDict_CheckExact(t.barriers) || !PyDict_CheckExact(t.queues) ||
        !PyBytes_Check(t.auth_key) || !PyType_Check(t.waiter_type) || !PyType_Check(t.wake_type)) {
        PyErr_SetString(PyExc_TypeError, "read_quick: ctx = (data, waiters, barriers, lock, max_key, "
                        "max_value, auth_key, budget, queues, Waiter, _Wake, server, max_pairs)");
        return NULL;
    }
    t.max_key = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ctx, 4));
    t.max_value = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ctx, 5));
    t.max_pairs = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ctx, 12));
    t.mux = mux;
    long budget = PyLong_AsLong(PyTuple_GET_ITEM(ctx, 7));
    if (PyErr_Occurred()) return NULL;

    /* On this thread's stack: a waiter's constructor or fire() runs Python code, during which
     * another server's loop thread may read into its own buffer. */
    char rbuf[READ_SIZE];
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
    PyObject *result = NULL;
    t.fired = PyList_New(0);
    if (t.fired == NULL) goto done;

    /* The table's lock, without blocking: nothing runs while another thread is in the middle of
     * a LocalKV read-modify-write (then all of the read goes to the Python path, which waits for
     * the lock), and no other thread touches the table while this read's Python calls (a
     * waiter's constructor) might let it run. */
    PyObject *got_lock = PyObject_CallMethodOneArg(lock, str_acquire, Py_False);
    if (got_lock == NULL) goto done;
    int locked = got_lock == Py_True;
    Py_DECREF(got_lock);
    int failed = 0;
    if (locked && !validated) { /* the handshake: VALIDATE with the magic comes first */
        uint32_t magic = 0;
        if (n >= 5) memcpy(&magic, rbuf + 1, 4);
        if (n >= 5 && rbuf[0] == OP_VALIDATE && magic == VALIDATION_MAGIC) {
            if (PyObject_SetAttr(conn, str_validated, Py_True) < 0) failed = 1;
            validated = 1;
            pos = 5;
            count = 1;
        }
    }
    if (locked && validated && !failed && mux) {
        while (pos + 5 <= n && count < budget) { /* u32 tag + a frame; replies carry the tag */
            size_t mark = o.len;
            memcpy(&t.tag, rbuf + pos, 4);
            if (out_put(&o, rbuf + pos, 4) < 0) {
                failed = 1;
                break;
            }
            Py_ssize_t end = (unsigned char)rbuf[pos + 4] == OP_MULTI_SET
                                 ? multi_set(&t, rbuf, pos + 4, n)
                                 : (unsigned char)rbuf[pos + 4] == OP_VALIDATE ? 0
                                 : one(&t, rbuf, pos + 4, n, &o);
            if (end <= 0) {
                o.len = mark;
                if (end < 0) failed = 1;
                break;
            }
            if (o.len == mark + 4) o.len = mark; /* no reply (yet): no tag either */
            pos = (size_t)end;
            count++;
            t.registered = 0; /* a mux waiter does not hold up the frames behind it */
        }
    } else if (locked && validated && !failed) {
        while (pos < n && count < budget) {
            Py_ssize_t end = one(&t, rbuf, pos, n, &o);
            if (end < 0) {
                failed = 1;
                break;
            }
            if (end == 0) break;
            pos = (size_t)end;
            count++;
            if (t.registered) break; /* its reply comes when it fires: the rest in order, by Python */
        }
    }
    if (locked) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallMethodNoArgs(lock, str_release);
        Py_XDECREF(r);
        if (r == NULL) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            goto done;
        }
        PyErr_Restore(et, ev, tb);
    }
    if (failed) goto done;
    size_t sent = 0;
    if ((pos == n || mux) && o.len) {
        ssize_t r = send(fd, o.p, o.len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r > 0) sent = (size_t)r; /* an error: the Python path's flush sees it and closes */
    }
    int queued = 0;
    if (mux && sent < o.len) { /* on conn.out before a waiter of this connection is answered */
        PyObject *rest = PyBytes_FromStringAndSize(o.p + sent, (Py_ssize_t)(o.len - sent));
        PyObject *out = rest ? PyObject_GetAttr(conn, str_out) : NULL;
        PyObject *ob = out ? PyObject_GetAttr(conn, str_out_bytes) : NULL;
        PyObject *more = ob ? PyLong_FromSsize_t(PyLong_AsSsize_t(ob) + (Py_ssize_t)(o.len - sent)) : NULL;
        int bad = more == NULL || PyList_Append(out, rest) < 0 ||
                  PyObject_SetAttr(conn, str_out_bytes, more) < 0;
        Py_XDECREF(rest); Py_XDECREF(out); Py_XDECREF(ob); Py_XDECREF(more);
        if (bad) goto done;
        sent = o.len;
        queued = 1; /* the Python path flushes it (the tuple below) */
    }
    if (pos == n && sent == o.len && !queued) {
        result = PyLong_FromLong(count);
    } else {
        result = Py_BuildValue("(ly#y#)", count, o.p + sent, (Py_ssize_t)(o.len - sent),
                               rbuf + pos, (Py_ssize_t)(n - pos));
    }
    if (result != NULL && deliver(&t) < 0) Py_CLEAR(result);
done:
    Py_XDECREF(t.fired);
    out_free(&o);
    return result;
}

/* ------------------------------------------------------------------ the node proxy's read path */

/* A `protocol.Request` (a NamedTuple: a tuple subtype without a dict) made without calling its
 * Python-level __new__: (op, keys, values, num). Steals keys and values. */
static PyObject *new_request(PyTypeObject *rt, int op, PyObject *keys, PyObject *values,
                             long long num) {
    PyObject *r = NULL, *o = NULL, *nm = NULL;
    if (keys == NULL || values == NULL) goto fail;
    o = PyLong_FromLong(op);
    nm = PyLong_FromLongLong(num);
    if (o == NULL || nm == NULL) goto fail;
    r = rt->tp_alloc(rt, 4);
    if (r == NULL) goto fail;
    PyTuple_SET_ITEM(r, 0, o);
    PyTuple_SET_ITEM(r, 1, keys);
    PyTuple_SET_ITEM(r, 2, values);
    PyTuple_SET_ITEM(r, 3, nm);
    return r;
fail:
    Py_XDECREF(keys);
    Py_XDECREF(values);
    Py_XDECREF(o);
    Py_XDECREF(nm);
    return NULL;
}

typedef struct {
    PyObject *conn, *batch, *slots, *auth_key;
    PyTypeObject *request;
    uint64_t max_key, max_value;
} Batch;

/* Queue one complete frame at buf[pos:] as `StoreProxy._handle` does for a validated
 * connection: (conn, request, slot) onto the batch, the slot (a one-item list, [None] until
 * its reply arrives) onto conn.slots for ops with a reply. Only SET (not the auth key), GET,
 * ADD, and WAIT / CHECK of 1..MAX_KEYS keys; anything else, an incomplete frame or a length
 * over a limit: 0 (the Python path decides). The frame's end, or -1 on error. */
static Py_ssize_t queue_one(Batch *b, const char *buf, size_t pos, size_t n) {
    if (pos + 9 > n) return 0;
    int op = (unsigned char)buf[pos];
    PyObject *req = NULL;
    size_t end;
    if (op == OP_WAIT || op == OP_CHECK) {
        uint64_t count = rd_u64(buf + pos + 1);
        if (count < 1 || count > MAX_KEYS) return 0;
        size_t p = pos + 9;
        for (uint64_t i = 0; i < count; i++) {
            if (p + 8 > n) return 0;
            uint64_t kl = rd_u64(buf + p);
            if (kl > b->max_key || kl > n - p - 8) return 0;
            p += 8 + kl;
        }
        end = p;
        PyObject *keys = PyTuple_New((Py_ssize_t)count);
        if (keys == NULL) return -1;
        size_t q = pos + 9;
        for (uint64_t i = 0; i < count; i++) {
            uint64_t kl = rd_u64(buf + q);
            PyObject *key = PyBytes_FromStringAndSize(buf + q + 8, (Py_ssize_t)kl);
            if (key == NULL) {
                Py_DECREF(keys);
                return -1;
            }
            PyTuple_SET_ITEM(keys, (Py_ssize_t)i, key);
            q += 8 + kl;
        }
        req = new_request(b->request, op, keys, PyTuple_New(0), 0);
    } else if (op == OP_SET || op == OP_GET || op == OP_ADD) {
        uint64_t kl = rd_u64(buf + pos + 1);
        size_t s = pos + 9;
        if (kl > b->max_key || kl > n - s) return 0;
        size_t e = s + kl;
        if (op == OP_GET) {
            end = e;
            req = new_request(b->request, op, Py_BuildValue("(y#)", buf + s, (Py_ssize_t)kl),
                              PyTuple_New(0), 0);
        } else {
            if (e + 8 > n) return 0;
            if (op == OP_SET) {
                uint64_t vl = rd_u64(buf + e);
                if (vl > b->max_value || vl > n - e - 8) return 0;
                if ((Py_ssize_t)kl == PyBytes_GET_SIZE(b->auth_key) &&
                    memcmp(buf + s, PyBytes_AS_STRING(b->auth_key), kl) == 0)
                    return 0; /* the proxy's own business: Python */
                end = e + 8 + vl;
                req = new_request(b->request, op, Py_BuildValue("(y#)", buf + s, (Py_ssize_t)kl),
                                  Py_BuildValue("(y#)", buf + e + 8, (Py_ssize_t)vl), 0);
            } else {
                int64_t amount;
                memcpy(&amount, buf + e, 8);
                end = e + 8;
                req = new_request(b->request, op, Py_BuildValue("(y#)", buf + s, (Py_ssize_t)kl),
                                  PyTuple_New(0), (long long)amount);
            }
        }
    } else {
        return 0;
    }
    if (req == NULL) return -1;
    PyObject *slot = Py_None;
    Py_INCREF(slot);
    if (op != OP_SET) { /* protocol.NO_REPLY: of these, only SET has no reply */
        Py_DECREF(slot);
        slot = PyList_New(1);
        if (slot == NULL) {
            Py_DECREF(req);
            return -1;
        }
        Py_INCREF(Py_None);
        PyList_SET_ITEM(slot, 0, Py_None);
        PyObject *r = PyObject_CallMethodOneArg(b->slots, str_append, slot);
        if (r == NULL) {
            Py_DECREF(slot);
            Py_DECREF(req);
            return -1;
        }
        Py_DECREF(r);
    }
    PyObject *item = PyTuple_Pack(3, b->conn, req, slot);
    Py_DECREF(req);
    Py_DECREF(slot);
    if (item == NULL) return -1;
    int r = PyList_Append(b->batch, item);
    Py_DECREF(item);
    return r < 0 ? -1 : (Py_ssize_t)end;
}

static PyObject *proxy_queue(PyObject *conn, PyObject *ctx);

static PyObject *proxy_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != PCTX_SIZE) {
        PyErr_SetString(PyExc_TypeError, "proxy_read(conn, ctx): ctx is a 6-tuple");
        return NULL;
    }
    return proxy_queue(args[0], args[1]);
}

static PyObject *proxy_queue(PyObject *conn, PyObject *ctx) {
    Batch b = {conn, PyTuple_GET_ITEM(ctx, 0), NULL, PyTuple_GET_ITEM(ctx, 2),
               (PyTypeObject *)PyTuple_GET_ITEM(ctx, 1), 0, 0};
    if (!PyList_CheckExact(b.batch) || !PyType_Check((PyObject *)b.request) ||
        !PyType_IsSubtype(b.request, &PyTuple_Type) || !PyBytes_Check(b.auth_key)) {
        PyErr_SetString(PyExc_TypeError, "proxy_read: ctx = (batch: list, Request, auth_key, "
                        "max_key, max_value, budget)");
        return NULL;
    }
    b.max_key = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ctx, 3));
    b.max_value = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(ctx, 4));
    long budget = PyLong_AsLong(PyTuple_GET_ITEM(ctx, 5));
    if (PyErr_Occurred()) return NULL;
    int fd = conn_fd(conn);
    if (fd < 0) return NULL;
    char rbuf[READ_SIZE];
    ssize_t got = recv(fd, rbuf, READ_SIZE, MSG_DONTWAIT);
    if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) Py_RETURN_NONE;
        Py_RETURN_FALSE;
    }
    if (got == 0) Py_RETURN_FALSE;
    b.slots = PyObject_GetAttr(conn, str_slots);
    if (b.slots == NULL) return NULL;
    size_t n = (size_t)got, pos = 0;
    long count = 0;
    PyObject *result = NULL;
    while (pos < n && count < budget) {
        Py_ssize_t end = queue_one(&b, rbuf, pos, n);
        if (end < 0) goto done;
        if (end == 0) break;
        pos = (size_t)end;
        count++;
    }
    if (pos == n)
        result = PyLong_FromLong(count);
    else
        result = Py_BuildValue("(ly#)", count, rbuf + pos, (Py_ssize_t)(n - pos));
done:
    Py_DECREF(b.slots);
    return result;
}

/* ------------------------------------------------------------------ output */

/* What `LoopServer._flush` does for each connection of `conns` that is open, not waiting for
 * EPOLLOUT and has output queued (bytes items only): joins it and sends it in one send().
 * Sent whole: c.out emptied, c.out_bytes = 0. Sent in part: c.out = [the rest]. The
 * connections left to the Python flush (a short or failed send, an item that is not bytes) are
 * returned in a list. */
static PyObject *flush_out(PyObject *self, PyObject *conns) {
    (void)self;
    if (!PyList_Check(conns)) {
        PyErr_SetString(PyExc_TypeError, "flush_out(conns): a list");
        return NULL;
    }
    PyObject *left = PyList_New(0);
    if (left == NULL) return NULL;
    Out o;
    o.p = o.small;
    o.cap = sizeof o.small;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(conns); i++) {
        PyObject *c = PyList_GET_ITEM(conns, i);
        PyObject *out = NULL;
        int skip = 0, py = 0;
        PyObject *v = PyObject_GetAttr(c, str_closed);
        if (v == NULL) goto fail;
        skip = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (skip < 0) goto fail;
        if (skip) continue;
        v = PyObject_GetAttr(c, str_want_write);
        if (v == NULL) goto fail;
        skip = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (skip < 0) goto fail;
        if (skip) continue;
        out = PyObject_GetAttr(c, str_out);
        if (out == NULL) goto fail;
        Py_ssize_t k = PyList_Check(out) ? PyList_GET_SIZE(out) : -1;
        if (k == 0) {
            Py_DECREF(out);
            continue;
        }
        o.len = 0;
        for (Py_ssize_t j = 0; j < k && !py; j++) {
            PyObject *d = PyList_GET_ITEM(out, j);
            if (!PyBytes_Check(d)) py = 1;
            else if (out_put(&o, PyBytes_AS_STRING(d), (size_t)PyBytes_GET_SIZE(d)) < 0) {
                Py_DECREF(out);
                goto fail;
            }
        }
        if (k < 0) py = 1;
        ssize_t sent = 0;
        if (!py) {
            int fd = conn_fd(c);
            if (fd < 0) {
                Py_DECREF(out);
                goto fail;
            }
            sent = send(fd, o.p, o.len, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (sent < 0) sent = 0; /* EAGAIN or an error: the Python flush sees it again */
            if ((size_t)sent == o.len) {
                if (PyList_SetSlice(out, 0, k, NULL) < 0 ||
                    PyObject_SetAttr(c, str_out_bytes, zero) < 0) {
                    Py_DECREF(out);
                    goto fail;
                }
            } else {
                py = 1;
                if (sent > 0) { /* keep what is left, in one piece */
                    PyObject *rest =
                        PyBytes_FromStringAndSize(o.p + sent, (Py_ssize_t)(o.len - sent));
                    PyObject *nb = rest == NULL ? NULL : PyLong_FromSsize_t(PyBytes_GET_SIZE(rest));
                    int bad = rest == NULL || nb == NULL || PyList_SetSlice(out, 0, k, NULL) < 0 ||
                              PyList_Append(out, rest) < 0 ||
                              PyObject_SetAttr(c, str_out_bytes, nb) < 0;
                    Py_XDECREF(rest);
                    Py_XDECREF(nb);
                    if (bad) {
                        Py_DECREF(out);
                        goto fail;
                    }
                }
            }
        }
        Py_DECREF(out);
        if (py && PyList_Append(left, c) < 0) goto fail;
    }
    out_free(&o);
    return left;
fail:
    out_free(&o);
    Py_DECREF(left);
    return NULL;
}

/* ------------------------------------------------------------------ one turn of the loop */

/* Whether attribute `name` of `o` is true (1), false (0), or -1 on error. */
static int attr_true(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static double now_of(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whether `owner` has Python work queued for the end of the turn: a non-empty `_dirty`
 * (output a fired waiter queued) or `_backlog` (a connection over its budget). -1: error. */
static int owner_busy(PyObject *owner) {
    PyObject *names[2] = {str_dirty, str_backlog};
    for (int i = 0; i < 2; i++) {
        PyObject *v = PyObject_GetAttr(owner, names[i]);
        if (v == NULL) return -1;
        int t = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (t) return t;
    }
    return 0;
}

/* loop_turn's `accept`: the listening socket, the connection limit, the accepts per turn,
 * and the Python callable that adopts an accepted connection. lfd -1: none. */
typedef struct {
    int lfd;
    Py_ssize_t max_conns;
    long per_turn;
    PyObject *adopt;
} Accept;

/* "host:port" as `connection.peer_str` writes it: an IPv4-mapped IPv6 address as IPv4, another
 * IPv6 one in brackets. NULL without an exception: a family it does not know. */
static PyObject *peer_of(const struct sockaddr_storage *ss) {
    char h[INET6_ADDRSTRLEN];
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        if (inet_ntop(AF_INET, &a->sin_addr, h, sizeof h) == NULL) return NULL;
        return PyUnicode_FromFormat("%s:%u", h, (unsigned)ntohs(a->sin_port));
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        unsigned port = ntohs(a->sin6_port);
        if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
            if (inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], h, sizeof h) == NULL) return NULL;
            return PyUnicode_FromFormat("%s:%u", h, port);
        }
        if (inet_ntop(AF_INET6, &a->sin6_addr, h, sizeof h) == NULL) return NULL;
        return PyUnicode_FromFormat("[%s]:%u", h, port);
    }
    return NULL;
}

/* The listening socket's EPOLLIN: what `LoopServer._accept` does for up to `per_turn`
 * connections -- accept4 (non-blocking, close-on-exec), TCP_NODELAY, and `adopt(fd, peer)`,
 * which makes the connection object, registers it with the epoll set and counts it (and owns
 * the fd from the call on, also when it raises). Sets *hand_back when the rest of this event
 * is for the Python `_accept`: the connection limit is reached (it refuses them with its log
 * line) or accept4 failed with anything but "nothing left" (it logs the error). -1: an error. */
static int accept_some(const Accept *a, PyObject *conns, int *hand_back) {
    *hand_back = 0;
    for (long k = 0; k < a->per_turn; k++) {
        if (PyDict_GET_SIZE(conns) >= a->max_conns) {
            *hand_back = 1;
            return 0;
        }
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int cfd = accept4(a->lfd, (struct sockaddr *)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (cfd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            if (errno == EINTR || errno == ECONNABORTED) continue;
            *hand_back = 1;
            return 0;
        }
        const int one = 1;
        (void)setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* as _accept: best effort */
        PyObject *peer = peer_of(&ss);
        if (peer == NULL && !PyErr_Occurred()) peer = PyUnicode_FromString("?");
        if (peer == NULL) {
            close(cfd);
            return -1;
        }
        PyObject *fdo = PyLong_FromLong(cfd);
        if (fdo == NULL) {
            Py_DECREF(peer);
            close(cfd);
            return -1;
        }
        PyObject *args[2] = {fdo, peer};
        PyObject *r = PyObject_Vectorcall(a->adopt, args, 2, NULL); /* owns cfd from here */
        Py_DECREF(fdo);
        Py_DECREF(peer);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0; /* the rest, if any, next turn (level-triggered) */
}

/* One turn's events: fills `left` / `results` and counts, as loop_turn documents. */
static int turn_events(struct epoll_event *evs, int got, PyObject *conns, PyObject *ctx,
                       int proxy, const Accept *acc, PyObject *left, PyObject *results,
                       long *reads, long *requests) {
    for (int i = 0; i < got; i++) {
        int fd = evs[i].data.fd;
        uint32_t ev = evs[i].events;
        PyObject *conn = NULL;
        if (fd == acc->lfd && ev == EPOLLIN) { /* new connections: accepted here */
            int hand_back;
            if (accept_some(acc, conns, &hand_back) < 0) return -1;
            if (!hand_back) continue;
        }
        int mine = ev == EPOLLIN;
        if (mine) {
            PyObject *key = PyLong_FromLong(fd);
            if (key == NULL) return -1;
            conn = PyDict_GetItemWithError(conns, key); /* borrowed; held from the gate on */
            Py_DECREF(key);
            if (conn == NULL && PyErr_Occurred()) return -1;
            mine = conn != NULL;
        }
        if (mine && proxy) { /* StoreProxy._read's gate for proxy_read */
            Py_INCREF(conn);
            int a;
            if ((a = attr_true(conn, str_validated)) < 0) goto fail_conn;
            mine = a;
            if (mine && (a = attr_true(conn, str_buf)) < 0) goto fail_conn;
            mine = mine && !a;
            if (mine && (a = attr_true(conn, str_closed)) < 0) goto fail_conn;
            mine = mine && !a;
        } else if (mine) { /* LoopServer._read's gate for the C read path */
            Py_INCREF(conn);
            int a;
            if ((a = attr_true(conn, str_authed)) < 0) goto fail_conn;
            mine = a;
            int mux = 0;
            if (mine && (mux = attr_true(conn, str_mux)) < 0) goto fail_conn;
            if (mine && (a = attr_true(conn, str_buf)) < 0) goto fail_conn;
            mine = mine && !a;
            if (mine && (a = attr_true(conn, str_out)) < 0) goto fail_conn;
            mine = mine && !a;
            if (mine && (a = attr_true(conn, str_want_write)) < 0) goto fail_conn;
            mine = mine && !a;
            if (mine && (a = attr_true(conn, str_closed)) < 0) goto fail_conn;
            mine = mine && !a;
            if (mine && !mux) { /* a plain connection's one waiter: its reply comes first */
                PyObject *w = PyObject_GetAttr(conn, str_waiter);
                if (w == NULL) goto fail_conn;
                mine = w == Py_None;
                Py_DECREF(w);
            }
        }
        if (mine) {
            PyObject *r = proxy ? proxy_queue(conn, ctx) : quick(conn, ctx);
            if (r == NULL) goto fail_conn;
            if (PyLong_CheckExact(r)) {
                (*reads)++;
                *requests += PyLong_AsLong(r);
            } else if (r != Py_None) {
                PyObject *item = PyTuple_Pack(2, conn, r);
                if (item == NULL || PyList_Append(results, item) < 0) {
                    Py_XDECREF(item);
                    Py_DECREF(r);
                    goto fail_conn;
                }
                Py_DECREF(item);
            }
            Py_DECREF(r);
        }
        Py_XDECREF(conn); /* held since the gate (NULL: not a connection, or not EPOLLIN) */
        if (mine) continue;
        PyObject *pair = Py_BuildValue("(iI)", fd, (unsigned int)ev);
        if (pair == NULL || PyList_Append(left, pair) < 0) {
            Py_XDECREF(pair);
            return -1;
        }
        Py_DECREF(pair);
        continue;
    fail_conn:
        Py_DECREF(conn);
        return -1;
    }
    return 0;
}

/* loop_turn(epfd, conns, ctx, timeout, proxy=False, until=0.0, owner=None, hold=0.0,
 *           accept=None)
 *   -> (events, results, reads, requests, t0, cpu0, busy, max_s, max_cpu):
 * one epoll_wait (the GIL released; timeout in seconds, rounded up to ms as select.epoll
 * does), then, for each readable connection of `conns` (fd -> conn) that `LoopServer._read`
 * would give to the C read path (authenticated, plain, nothing buffered either way, no waiter,
 * no EPOLLOUT / error event), what `read_quick(conn, ctx)` does; with `accept` = (listening
 * fd, max connections, accepts per turn, adopt), the listening socket's EPOLLIN is accepted
 * here (`accept_some`; what it hands back is an event for Python). `events`: the (fd, mask)
 * pairs left to the Python loop, in epoll's order; `results`: (conn, result) for each read
 * whose result was not a plain count (False, or a tuple) -- the Python loop finishes those as
 * `_read` does; `reads` / `requests`: counted for the ones done here; t0 / cpu0: time.monotonic()
 * and time.thread_time() when the last epoll_wait returned.
 *
 * With `until` (a time.monotonic() deadline) and `owner` (the LoopServer) it turns again, in
 * C, while a turn leaves nothing to Python: every event was a read done here with a plain
 * count and `owner._dirty` and `owner._backlog` are empty -- and, for a proxy, its batch is
 * empty or held: `hold` > 0 (the proxy's `max_hold`, given while answers are outstanding)
 * and less than `hold` s passed since the batch's first request (`owner._batch_since`, which
 * this sets when it queues into an empty batch). Each wait is bounded by `timeout`, by `until`
 * and by the hold's end; a wait that ends without events ends the call. `busy` / `max_s` /
 * `max_cpu`: the summed wall time and the longest turn (wall, CPU) of the turns before the
 * last one, whose own the Python loop measures. So a loop whose turns need no Python (the
 * server's steady state; a proxy collecting a round while the previous one is upstream)
 * enters Python once per call, not once per turn. */
static PyObject *loop_turn(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    int proxy = nargs >= 5 ? PyObject_IsTrue(args[4]) : 0;
    if (proxy < 0) return NULL;
    PyObject *acc_arg = nargs >= 9 ? args[8] : Py_None;
    if (nargs < 4 || nargs > 9 || !PyDict_Check(args[1]) || !PyTuple_Check(args[2]) ||
        PyTuple_GET_SIZE(args[2]) != (proxy ? PCTX_SIZE : CTX_SIZE) ||
        (proxy && !PyList_Check(PyTuple_GET_ITEM(args[2], 0))) ||
        (acc_arg != Py_None && (!PyTuple_Check(acc_arg) || PyTuple_GET_SIZE(acc_arg) != 4 ||
                                !PyCallable_Check(PyTuple_GET_ITEM(acc_arg, 3))))) {
        PyErr_SetString(PyExc_TypeError, "loop_turn(epfd, conns: dict, ctx, timeout, proxy=False, "
                        "until=0.0, owner=None, hold=0.0, accept=None): ctx is read_quick's "
                        "13-tuple, or proxy_read's 6-tuple with proxy; accept is None or "
                        "(listening fd, max connections, accepts per turn, adopt(fd, peer))");
        return NULL;
    }
    Accept acc = {-1, 0, 0, NULL};
    if (acc_arg != Py_None) {
        acc.lfd = (int)PyLong_AsLong(PyTuple_GET_ITEM(acc_arg, 0));
        acc.max_conns = PyLong_AsSsize_t(PyTuple_GET_ITEM(acc_arg, 1));
        acc.per_turn = PyLong_AsLong(PyTuple_GET_ITEM(acc_arg, 2));
        acc.adopt = PyTuple_GET_ITEM(acc_arg, 3);
        if (PyErr_Occurred()) return NULL;
    }
    int epfd = (int)PyLong_AsLong(args[0]);
    double timeout = PyFloat_AsDouble(args[3]);
    double until = nargs >= 6 ? PyFloat_AsDouble(args[5]) : 0.0;
    double hold = nargs >= 8 ? PyFloat_AsDouble(args[7]) : 0.0;
    if (PyErr_Occurred()) return NULL;
    PyObject *owner = nargs >= 7 && args[6] != Py_None ? args[6] : NULL;
    PyObject *conns = args[1], *ctx = args[2];
    PyObject *batch = proxy ? PyTuple_GET_ITEM(ctx, 0) : NULL;
    int again = until > 0 && owner != NULL;
    PyObject *left = PyList_New(0), *results = PyList_New(0);
    long reads = 0, requests = 0;
    double t0 = 0, cpu0 = 0, busy = 0, max_s = 0, max_cpu = 0;
    if (left == NULL || results == NULL) goto fail;
    struct epoll_event evs[TURN_EVENTS];
    for (double wait = timeout;;) {
        int ms = wait < 0 ? -1 : (int)ceil(wait * 1000.0);
        Py_ssize_t queued = batch != NULL ? PyList_GET_SIZE(batch) : 0;
        int got;
        Py_BEGIN_ALLOW_THREADS
        got = epoll_wait(epfd, evs, TURN_EVENTS, ms);
        Py_END_ALLOW_THREADS
        t0 = now_of(CLOCK_MONOTONIC);
        cpu0 = now_of(CLOCK_THREAD_CPUTIME_ID);
        if (got < 0) {
            if (errno != EINTR) {
                PyErr_SetFromErrno(PyExc_OSError);
                goto fail;
            }
            got = 0;
        }
        if (turn_events(evs, got, conns, ctx, proxy, &acc, left, results, &reads, &requests) < 0)
            goto fail;
        if (!again || got == 0 || PyList_GET_SIZE(left) || PyList_GET_SIZE(results)) break;
        int b = owner_busy(owner);
        if (b < 0) goto fail;
        if (b) break;
        double end = now_of(CLOCK_MONOTONIC), stop = until;
        if (batch != NULL && PyList_GET_SIZE(batch) > 0) { /* a proxy's batch: held? */
            if (hold <= 0) break;
            double since = t0;
            if (queued == 0) { /* this turn began it */
                PyObject *v = PyFloat_FromDouble(t0);
                if (v == NULL || PyObject_SetAttr(owner, str_batch_since, v) < 0) {
                    Py_XDECREF(v);
                    goto fail;
                }
                Py_DECREF(v);
            } else {
                PyObject *v = PyObject_GetAttr(owner, str_batch_since);
                if (v == NULL) goto fail;
                since = PyFloat_AsDouble(v);
                Py_DECREF(v);
                if (since == -1.0 && PyErr_Occurred()) goto fail;
            }
            if (since + hold < stop) stop = since + hold;
        }
        if (end >= stop) break;
        double spent = end - t0, cpu = now_of(CLOCK_THREAD_CPUTIME_ID) - cpu0;
        busy += spent;
        if (spent > max_s) {
            max_s = spent;
            max_cpu = cpu;
        }
        wait = stop - end;
        if (timeout >= 0 && timeout < wait) wait = timeout;
    }
    return Py_BuildValue("(NNllddddd)", left, results, reads, requests, t0, cpu0, busy, max_s,
                         max_cpu);
fail:
    Py_XDECREF(left);
    Py_XDECREF(results);
    return NULL;
}

static PyMethodDef methods[] = {
    {"read_quick", (PyCFunction)(void (*)(void))read_quick, METH_FASTCALL,
     "read_quick(conn, ctx) -> None | False | int | (int, bytes, bytes); see the module doc."},
    {"proxy_read", (PyCFunction)(void (*)(void))proxy_read, METH_FASTCALL,
     "proxy_read(conn, ctx) -> None | False | int | (int, bytes); see the module doc."},
    {"loop_turn", (PyCFunction)(void (*)(void))loop_turn, METH_FASTCALL,
     "loop_turn(epfd, conns, ctx, timeout, proxy=False, until=0.0, owner=None, hold=0.0, "
     "accept=None) -> (events, results, reads, requests, t0, cpu0, busy, max_s, max_cpu); see "
     "the module doc."
    },
    {"flush_out", flush_out, METH_O,
     "flush_out(conns) -> list of the connections left to the Python flush; see the module doc."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "rendezvous.store._quickstore",
    "The store server's and node proxy's read paths for the common frames, and their flush, in C.",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__quickstore(void) {
    struct { PyObject **slot; const char *name; } names[] = {
        {&str_acquire, "acquire"}, {&str_release, "release"}, {&str_fd, "fd"},
        {&str_validated, "validated"}, {&str_done, "done"}, {&str_remaining, "remaining"},
        {&str_waiter, "waiter"}, {&str_fire, "fire"}, {&str_srv, "srv"}, {&str_c, "c"},
        {&str_tag, "tag"}, {&str_closed, "closed"}, {&str_out, "out"},
        {&str_want_write, "want_write"}, {&str_slots, "slots"}, {&str_append, "append"},
        {&str_out_bytes, "out_bytes"}, {&str_authed, "authed"}, {&str_mux, "mux"},
        {&str_buf, "buf"}, {&str_mux_waiters, "mux_waiters"},
        {&str_dirty, "_dirty"}, {&str_backlog, "_backlog"},
        {&str_batch_since, "_batch_since"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].name);
        if (*names[i].slot == NULL) return NULL;
    }
    zero = PyLong_FromLong(0);
    if (zero == NULL) return NULL;
    return PyModule_Create(&module);
}
