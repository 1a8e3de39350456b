/* The hot path of deltad.saved in C: the saved-tensor hooks, the store's
 * pack and unpack, and what a SavedTensor does when autograd lets go of it.
 *
 * Why C: in Python these cost about 3.5 us per saved tensor (frames,
 * attribute lookups, a __del__ per tensor), several times what the tensor
 * attributes they read cost; a managed step must cost next to nothing over
 * bare hooks when nothing is released. Only the common cases are here:
 * whatever releases, restores or recomputes stays in saved.py, called
 * from here (SavedStore subclasses Core). The state lives in these types'
 * members, so that both sides read and write the same fields.
 *
 * The stable ABI (Py_LIMITED_API): one build serves every CPython from
 * 3.10 on, e.g. the one that runs PyTorch on a GPU machine.
 *
 * Locking: the store's re-entrant lock (saved.py's) guards its state, as
 * in Python. Between two calls into Python, C code runs under the GIL
 * without interruption; state is left consistent before every call that
 * may run Python code (an allocation may run the garbage collector, and
 * with it SavedTensor deallocations on this thread). */

#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

static PyTypeObject *CountersType, *GroupType, *SavedType, *CoreType;
static PyObject *RESIDENT, *OFFLOADED, *EVICTED;
/* Interned names. */
static PyObject *s_version, *s_is_cuda, *s_get_device, *s_layout, *s_numel,
    *s_element_size, *s_requires_grad, *s_is_leaf, *s_base, *s_data_ptr,
    *s_nbytes, *s_calls, *s_acquire, *s_release, *s_new_iteration,
    *s_pack_over_budget, *s_unpack_slow, *s_check_version, *s_drop;

static int is_none(PyObject* o) { return o == NULL || o == Py_None; }

/* Replaces *slot with `value` (a new reference, or NULL for None). */
static void set_slot(PyObject** slot, PyObject* value) {
  PyObject* old = *slot;
  *slot = value;
  Py_XDECREF(old);
}

static void free_self(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  tp_free(self);
  Py_DECREF(tp);
}

/* ---- Counters: what the store did (ints, read without the lock). */

typedef struct {
  PyObject_HEAD long long saved_tensors, saved_groups, resident_bytes,
      peak_resident_bytes, host_bytes, offloads, offloaded_bytes, reloads,
      reloaded_bytes, prefetches, evictions, recomputes, recompute_ns,
      host_waits, stall_ns, overshoots, host_full;
} Counters;

#define COUNTER(name) \
  { #name, T_LONGLONG, offsetof(Counters, name), 0, NULL }
static PyMemberDef counters_members[] = {
    COUNTER(saved_tensors),   COUNTER(saved_groups),
    COUNTER(resident_bytes),  COUNTER(peak_resident_bytes),
    COUNTER(host_bytes),      COUNTER(offloads),
    COUNTER(offloaded_bytes), COUNTER(reloads),
    COUNTER(reloaded_bytes),  COUNTER(prefetches),
    COUNTER(evictions),       COUNTER(recomputes),
    COUNTER(recompute_ns),    COUNTER(host_waits),
    COUNTER(stall_ns),        COUNTER(overshoots),
    COUNTER(host_full),       {NULL, 0, 0, 0, NULL}};

/* A copy, frozen: what a block reports once it ended, taken at no cost. */
static PyObject* counters_snapshot(PyObject* self, PyObject* unused) {
  (void)unused;
  Counters* copy = (Counters*)PyType_GenericAlloc(Py_TYPE(self), 0);
  if (copy == NULL) return NULL;
  const size_t head = offsetof(Counters, saved_tensors);
  memcpy((char*)copy + head, (char*)self + head, sizeof(Counters) - head);
  return (PyObject*)copy;
}

static PyMethodDef counters_methods[] = {
    {"snapshot", counters_snapshot, METH_NOARGS,
     "A copy of the counters as they are now."},
    {NULL, NULL, 0, NULL}};

static PyType_Slot counters_slots[] = {
    {Py_tp_doc, "What the store did; ints, read without the lock."},
    {Py_tp_members, counters_members},
    {Py_tp_methods, counters_methods},
    {Py_tp_new, PyType_GenericNew},
    {0, NULL}};
static PyType_Spec counters_spec = {"deltad._savedcore.Counters",
                                    sizeof(Counters), 0, Py_TPFLAGS_DEFAULT,
                                    counters_slots};

/* ---- Group: one storage's bytes and the saved tensors that view them.
 * Its fields are saved.py's (see _Group's description there). */

typedef struct {
  PyObject_HEAD PyObject *store, *key, *state, *tensors, *metas, *host, *flat,
      *event, *call, *retained, *evicted_sources, *versions;
  Py_ssize_t nbytes, position, live, dependents;
  char used, rebuilt;
} Group;

static Group* group_create(PyObject* store, PyObject* key, Py_ssize_t nbytes,
                           Py_ssize_t position, PyObject* call) {
  Group* g = (Group*)PyType_GenericAlloc(GroupType, 0);
  if (g == NULL) return NULL;
  g->tensors = PyList_New(0);
  g->evicted_sources = PyTuple_New(0);
  if (g->tensors == NULL || g->evicted_sources == NULL) {
    Py_DECREF(g);
    return NULL;
  }
  Py_INCREF(store);
  g->store = store;
  Py_INCREF(key);
  g->key = key;
  Py_INCREF(RESIDENT);
  g->state = RESIDENT;
  if (!is_none(call)) {
    Py_INCREF(call);
    g->call = call;
  }
  g->nbytes = nbytes;
  g->position = position;
  return g;
}

static PyObject* group_new(PyTypeObject* type, PyObject* args,
                           PyObject* kwargs) {
  (void)type;
  PyObject *store, *key, *call;
  Py_ssize_t nbytes, position;
  static char* names[] = {"store", "key", "nbytes", "position", "call", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOnnO", names, &store, &key,
                                   &nbytes, &position, &call))
    return NULL;
  return (PyObject*)group_create(store, key, nbytes, position, call);
}

static int group_traverse(PyObject* self, visitproc visit, void* arg) {
  Group* g = (Group*)self;
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(g->store);
  Py_VISIT(g->key);
  Py_VISIT(g->state);
  Py_VISIT(g->tensors);
  Py_VISIT(g->metas);
  Py_VISIT(g->host);
  Py_VISIT(g->flat);
  Py_VISIT(g->event);
  Py_VISIT(g->call);
  Py_VISIT(g->retained);
  Py_VISIT(g->evicted_sources);
  Py_VISIT(g->versions);
  return 0;
}

static int group_clear(PyObject* self) {
  Group* g = (Group*)self;
  Py_CLEAR(g->store);
  Py_CLEAR(g->key);
  Py_CLEAR(g->state);
  Py_CLEAR(g->tensors);
  Py_CLEAR(g->metas);
  Py_CLEAR(g->host);
  Py_CLEAR(g->flat);
  Py_CLEAR(g->event);
  Py_CLEAR(g->call);
  Py_CLEAR(g->retained);
  Py_CLEAR(g->evicted_sources);
  Py_CLEAR(g->versions);
  return 0;
}

static void group_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  group_clear(self);
  free_self(self);
}

#define OBJ(type, name) \
  { #name, T_OBJECT, offsetof(type, name), 0, NULL }
#define SSIZE(type, name) \
  { #name, T_PYSSIZET, offsetof(type, name), 0, NULL }
#define BOOL(type, name) \
  { #name, T_BOOL, offsetof(type, name), 0, NULL }
static PyMemberDef group_members[] = {OBJ(Group, store),
                                      OBJ(Group, key),
                                      OBJ(Group, state),
                                      OBJ(Group, tensors),
                                      OBJ(Group, metas),
                                      OBJ(Group, host),
                                      OBJ(Group, flat),
                                      OBJ(Group, event),
                                      OBJ(Group, call),
                                      OBJ(Group, retained),
                                      OBJ(Group, evicted_sources),
                                      OBJ(Group, versions),
                                      SSIZE(Group, nbytes),
                                      SSIZE(Group, position),
                                      SSIZE(Group, live),
                                      SSIZE(Group, dependents),
                                      BOOL(Group, used),
                                      BOOL(Group, rebuilt),
                                      {NULL, 0, 0, 0, NULL}};

static PyType_Slot group_slots[] = {
    {Py_tp_doc, "One storage's bytes and the saved tensors that view them."},
    {Py_tp_members, group_members},
    {Py_tp_new, group_new},
    {Py_tp_traverse, group_traverse},
    {Py_tp_clear, group_clear},
    {Py_tp_dealloc, group_dealloc},
    {0, NULL}};
static PyType_Spec group_spec = {"deltad._savedcore.Group", sizeof(Group), 0,
                                 Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                                 group_slots};

/* ---- Core: the store's hot state and its hooks. */

typedef struct {
  PyObject_HEAD PyObject *lock, *acquire, *release;
  Counters* counters;
  PyObject *groups, *order, *by_position, *unpacked, *dying, *recompute;
  Py_ssize_t alive;
  long long budget;
  char busy;
  /* The hooks' filter (configure_hooks). */
  char cuda;
  Py_ssize_t device_index;
  long long min_bytes;
  PyObject *capturing, *strided, *fixed, *storage_fn;
} Core;

/* ---- SavedTensor: what autograd keeps instead of a saved tensor. Not
 * tracked by the garbage collector: nothing it references can refer back
 * to it. */

typedef struct {
  PyObject_HEAD PyObject* group;
  Py_ssize_t index;
  long long version;
} Saved;

static PyObject* saved_create(Group* group, Py_ssize_t index,
                              long long version) {
  Saved* s = (Saved*)PyType_GenericAlloc(SavedType, 0);
  if (s == NULL) return NULL;
  Py_INCREF(group);
  s->group = (PyObject*)group;
  s->index = index;
  s->version = version;
  return (PyObject*)s;
}

static PyObject* saved_new(PyTypeObject* type, PyObject* args,
                           PyObject* kwargs) {
  (void)type;
  PyObject* group;
  Py_ssize_t index;
  long long version;
  static char* names[] = {"group", "index", "version", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!nL", names, GroupType,
                                   &group, &index, &version))
    return NULL;
  return saved_create((Group*)group, index, version);
}

static int member_died(Core* core, Group* group, Py_ssize_t index);

static void saved_dealloc(PyObject* self) {
  Saved* s = (Saved*)self;
  PyObject* group = s->group;
  s->group = NULL;
  if (group != NULL) {
    Group* g = (Group*)group;
    if (g->store != NULL && PyObject_TypeCheck(g->store, CoreType)) {
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);
      /* As a __del__ would: an error here has no caller to go to (at
       * interpreter shutdown the store may be half gone). */
      if (member_died((Core*)g->store, g, s->index) < 0) PyErr_Clear();
      PyErr_Restore(type, value, traceback);
    }
    Py_DECREF(group);
  }
  free_self(self);
}

static PyMemberDef saved_members[] = {
    {"group", T_OBJECT, offsetof(Saved, group), READONLY, NULL},
    {"index", T_PYSSIZET, offsetof(Saved, index), READONLY, NULL},
    {"version", T_LONGLONG, offsetof(Saved, version), READONLY, NULL},
    {NULL, 0, 0, 0, NULL}};

static PyType_Slot saved_slots[] = {
    {Py_tp_doc,
     "What autograd keeps instead of a saved tensor: its group and its "
     "place there. The tensor itself stays in the group while resident."},
    {Py_tp_members, saved_members},
    {Py_tp_new, saved_new},
    {Py_tp_dealloc, saved_dealloc},
    {0, NULL}};
static PyType_Spec saved_spec = {"deltad._savedcore.SavedTensor", sizeof(Saved),
                                 0, Py_TPFLAGS_DEFAULT, saved_slots};

/* ---- Core's helpers. */

static int lock_acquire(Core* c) {
  if (c->acquire == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "deltad: the store has no lock");
    return -1;
  }
  PyObject* r = PyObject_CallObject(c->acquire, NULL);
  if (r == NULL) return -1;
  Py_DECREF(r);
  return 0;
}

/* Releases the lock whether or not an error is pending (kept). */
static void lock_release(Core* c) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* r = PyObject_CallObject(c->release, NULL);
  if (r == NULL) {
    PyErr_WriteUnraisable(c->release);
  } else {
    Py_DECREF(r);
  }
  PyErr_Restore(type, value, traceback);
}

static int get_ll(PyObject* obj, PyObject* name, long long* out) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == NULL) return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int call_ll(PyObject* obj, PyObject* name, long long* out) {
  PyObject* v = PyObject_CallMethodObjArgs(obj, name, NULL);
  if (v == NULL) return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* 1, 0, or -1 on error. */
static int get_truth(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == NULL) return -1;
  int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  return r;
}

static int check_list(PyObject* o, const char* what) {
  if (o != NULL && PyList_Check(o)) return 0;
  PyErr_Format(PyExc_TypeError, "deltad: the store's %s is not a list", what);
  return -1;
}

static int check_dict(PyObject* o) {
  if (o != NULL && PyDict_Check(o)) return 0;
  PyErr_SetString(PyExc_TypeError, "deltad: the store's groups are not a dict");
  return -1;
}

/* Raises (through saved.py) if a member changed in place since it was
 * saved; its version differs from the saved one. */
static int check_version(Core* c, Saved* s, PyObject* tensor) {
  long long version;
  if (get_ll(tensor, s_version, &version) < 0) return -1;
  if (version == s->version) return 0;
  PyObject* r = PyObject_CallMethodObjArgs(
      (PyObject*)c, s_check_version, s->group, (PyObject*)s, tensor, NULL);
  if (r == NULL) return -1;
  Py_DECREF(r);
  return 0;
}

/* ---- Core: pack, unpack, a member's death. */

static PyObject* store_pack(Core* c, PyObject* tensor, PyObject* key,
                            PyObject* storage) {
  if (lock_acquire(c) < 0) return NULL;
  PyObject* result = NULL;
  Group* g = NULL;
  c->counters->saved_tensors++;
  if (check_dict(c->groups) < 0) goto done;
  PyObject* found = PyDict_GetItemWithError(c->groups, key);
  if (found == NULL && PyErr_Occurred()) goto done;
  long long version;
  if (found != NULL && Py_TYPE(found) == GroupType &&
      ((Group*)found)->state == RESIDENT) {
    /* Another view of a storage saved already. */
    g = (Group*)found;
    Py_INCREF(g);
    if (check_list(g->tensors, "group's tensors") < 0) goto done;
    if (get_ll(tensor, s_version, &version) < 0) goto done;
    Py_ssize_t index = PyList_Size(g->tensors);
    if (PyList_Append(g->tensors, tensor) < 0) goto done;
    g->live++;
    result = saved_create(g, index, version);
    if (result == NULL) {
      /* Not saved after all: the group is as it was. */
      g->live--;
      Py_INCREF(Py_None);
      (void)PyList_SetItem(g->tensors, index, Py_None);
    }
    goto done;
  }
  if (c->alive == 0) {
    /* No saved tensor is alive: a new forward begins. */
    PyObject* r =
        PyObject_CallMethodObjArgs((PyObject*)c, s_new_iteration, NULL);
    if (r == NULL) goto done;
    Py_DECREF(r);
  }
  long long nbytes;
  if (call_ll(storage, s_nbytes, &nbytes) < 0) goto done;
  PyObject* call = Py_None; /* the module call that produced it, if known */
  if (c->recompute == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "deltad: the store has no recorder");
    goto done;
  }
  PyObject* calls = PyObject_GetAttr(c->recompute, s_calls);
  if (calls == NULL) goto done;
  if (PyDict_Check(calls) && PyDict_Size(calls) > 0) {
    call = PyDict_GetItemWithError(calls, key);
    if (call == NULL) {
      if (PyErr_Occurred()) {
        Py_DECREF(calls);
        goto done;
      }
      call = Py_None;
    }
  }
  if (check_list(c->by_position, "by_position") < 0 ||
      check_list(c->order, "order") < 0) {
    Py_DECREF(calls);
    goto done;
  }
  g = group_create((PyObject*)c, key, (Py_ssize_t)nbytes,
                   PyList_Size(c->by_position), call);
  Py_DECREF(calls);
  if (g == NULL) goto done;
  if (get_ll(tensor, s_version, &version) < 0) goto done;
  if (PyList_Append(g->tensors, tensor) < 0) goto done;
  g->live = 1;
  if (check_dict(c->groups) < 0 ||
      PyDict_SetItem(c->groups, key, (PyObject*)g) < 0)
    goto done;
  c->alive++;
  if (PyList_Append(c->order, (PyObject*)g) < 0 ||
      PyList_Append(c->by_position, (PyObject*)g) < 0)
    goto done;
  Counters* k = c->counters;
  k->saved_groups++;
  k->resident_bytes += nbytes;
  if (k->resident_bytes > k->peak_resident_bytes) {
    /* Past the budget only until the release below. */
    k->peak_resident_bytes = k->resident_bytes;
  }
  PyObject* saved = saved_create(g, 0, version);
  if (saved == NULL) goto done;
  if (k->resident_bytes > c->budget) {
    PyObject* r = PyObject_CallMethodObjArgs((PyObject*)c, s_pack_over_budget,
                                             (PyObject*)g, NULL);
    if (r == NULL) {
      Py_DECREF(saved);
      goto done;
    }
    Py_DECREF(r);
  }
  result = saved;
done:
  lock_release(c);
  Py_XDECREF(g);
  return result;
}

static PyObject* core_pack(PyObject* self, PyObject* args) {
  PyObject *tensor, *key, *storage;
  if (!PyArg_ParseTuple(args, "OOO", &tensor, &key, &storage)) return NULL;
  return store_pack((Core*)self, tensor, key, storage);
}

/* The tensor at `index` of a group's members (new reference), or None. */
static PyObject* member(Group* g, Py_ssize_t index) {
  if (g->tensors == NULL || !PyList_Check(g->tensors) || index < 0 ||
      index >= PyList_Size(g->tensors))
    Py_RETURN_NONE;
  PyObject* t = PyList_GetItem(g->tensors, index);
  Py_INCREF(t);
  return t;
}

static PyObject* store_unpack(Core* c, Saved* s) {
  Group* g = (Group*)s->group;
  PyObject* tensor;
  if (g->used && is_none(g->flat)) {
    /* Used already by backward: resident, never released again. */
    tensor = member(g, s->index);
    if (tensor != Py_None) {
      if (check_version(c, s, tensor) < 0) {
        Py_DECREF(tensor);
        return NULL;
      }
      return tensor;
    }
    Py_DECREF(tensor);
  }
  if (lock_acquire(c) < 0) return NULL;
  tensor = NULL;
  if (g->state == RESIDENT && is_none(g->flat) &&
      c->counters->host_bytes == 0) {
    /* Resident and nothing to prefetch: the first use marks the group. */
    tensor = member(g, s->index);
    if (tensor == Py_None) {
      Py_CLEAR(tensor);
    } else if (!g->used) {
      PyObject* position = PyLong_FromSsize_t(g->position);
      if (position == NULL || check_list(c->unpacked, "unpacked") < 0 ||
          PyList_Append(c->unpacked, position) < 0) {
        Py_XDECREF(position);
        Py_CLEAR(tensor);
        lock_release(c);
        return NULL;
      }
      Py_DECREF(position);
      g->used = 1;
    }
  }
  lock_release(c);
  if (tensor == NULL) {
    /* Released, restored or prefetching: saved.py's work. */
    return PyObject_CallMethodObjArgs((PyObject*)c, s_unpack_slow, (PyObject*)s,
                                      NULL);
  }
  if (check_version(c, s, tensor) < 0) {
    Py_DECREF(tensor);
    return NULL;
  }
  return tensor;
}

static PyObject* core_unpack(PyObject* self, PyObject* saved) {
  if (!PyObject_TypeCheck(saved, SavedType)) {
    PyErr_SetString(PyExc_TypeError, "unpack takes a SavedTensor");
    return NULL;
  }
  return store_unpack((Core*)self, (Saved*)saved);
}

/* A SavedTensor died: autograd let go of it. The group's bytes are let go
 * with its last member, unless an evicted group's recompute still reads
 * them. 0, or -1 with an error. */
static int member_died(Core* c, Group* g, Py_ssize_t index) {
  if (lock_acquire(c) < 0) return -1;
  int rc = -1;
  PyObject* tensor = NULL; /* dropped once the lock is let go */
  if (c->busy) {
    /* Collected inside the store's own work (same thread, the lock is
     * re-entrant): the group may be half released or restored, so it is
     * handled once that work is done. */
    PyObject* entry = Py_BuildValue("(On)", (PyObject*)g, index);
    if (entry == NULL || check_list(c->dying, "dying") < 0 ||
        PyList_Append(c->dying, entry) < 0) {
      Py_XDECREF(entry);
      goto done;
    }
    Py_DECREF(entry);
    rc = 0;
    goto done;
  }
  tensor = member(g, index);
  if (tensor != Py_None) {
    Py_INCREF(Py_None);
    if (PyList_SetItem(g->tensors, index, Py_None) < 0) goto done;
  }
  g->live--;
  if (g->live > 0) {
    rc = 0;
    goto done;
  }
  if (g->dependents > 0) {
    /* An evicted group's recompute still reads these bytes. */
    if (g->state == RESIDENT && tensor != Py_None) {
      Py_INCREF(tensor);
      set_slot(&g->retained, tensor);
    }
    rc = 0;
    goto done;
  }
  int sources =
      is_none(g->evicted_sources) ? 0 : PyObject_IsTrue(g->evicted_sources);
  if (sources < 0) goto done;
  if (g->state == RESIDENT && is_none(g->flat) && !sources) {
    /* The common end of a saved storage: backward used it. */
    if (check_dict(c->groups) < 0) goto done;
    PyObject* found = PyDict_GetItemWithError(c->groups, g->key);
    if (found == NULL && PyErr_Occurred()) goto done;
    if (found == (PyObject*)g && PyDict_DelItem(c->groups, g->key) < 0)
      goto done;
    c->alive--;
    c->counters->resident_bytes -= g->nbytes;
    Py_INCREF(Py_None);
    set_slot(&g->state, Py_None);
    set_slot(&g->call, NULL);
    set_slot(&g->retained, NULL);
    PyObject* empty = PyList_New(0);
    if (empty == NULL) goto done;
    set_slot(&g->tensors, empty);
    rc = 0;
    goto done;
  }
  PyObject* r =
      PyObject_CallMethodObjArgs((PyObject*)c, s_drop, (PyObject*)g, NULL);
  if (r == NULL) goto done;
  Py_DECREF(r);
  rc = 0;
done:
  lock_release(c);
  Py_XDECREF(tensor);
  return rc;
}

static PyObject* core_member_died(PyObject* self, PyObject* args) {
  PyObject* group;
  Py_ssize_t index;
  if (!PyArg_ParseTuple(args, "O!n", GroupType, &group, &index)) return NULL;
  if (member_died((Core*)self, (Group*)group, index) < 0) return NULL;
  Py_RETURN_NONE;
}

/* ---- The hooks. */

/* The pack hook: what the store keeps (a SavedTensor), or the tensor as it
 * is when it is not the store's (another device, sparse, small, a
 * parameter's storage, or a CUDA graph being captured). */
static PyObject* core_hook_pack(PyObject* self, PyObject* tensor) {
  Core* c = (Core*)self;
  int r = get_truth(tensor, s_is_cuda);
  if (r < 0) return NULL;
  if (r != c->cuda) goto as_it_is;
  if (c->cuda) {
    long long index;
    if (call_ll(tensor, s_get_device, &index) < 0) return NULL;
    if (index != c->device_index) goto as_it_is;
    if (!is_none(c->capturing)) {
      /* A CUDA graph being captured keeps its tensors where they are. */
      PyObject* v = PyObject_CallObject(c->capturing, NULL);
      if (v == NULL) return NULL;
      r = PyObject_IsTrue(v);
      Py_DECREF(v);
      if (r < 0) return NULL;
      if (r) goto as_it_is;
    }
  }
  PyObject* layout = PyObject_GetAttr(tensor, s_layout);
  if (layout == NULL) return NULL;
  Py_DECREF(layout); /* compared by identity only */
  if (layout != c->strided) goto as_it_is;
  long long numel;
  if (call_ll(tensor, s_numel, &numel) < 0) return NULL;
  if (c->min_bytes > 1) {
    long long size;
    if (call_ll(tensor, s_element_size, &size) < 0) return NULL;
    if (numel * size < c->min_bytes) goto as_it_is;
  } else if (numel < c->min_bytes) {
    goto as_it_is; /* an element has at least one byte */
  }
  if (is_none(c->fixed)) {
    /* No model to list its parameters: leaves that need grad and their
     * views are taken for them. */
    int grad = get_truth(tensor, s_requires_grad);
    if (grad < 0) return NULL;
    if (grad) {
      int leaf = get_truth(tensor, s_is_leaf);
      if (leaf < 0) return NULL;
      if (leaf) goto as_it_is;
    }
    PyObject* base = PyObject_GetAttr(tensor, s_base);
    if (base == NULL) return NULL;
    if (base != Py_None) {
      int leaf = get_truth(base, s_is_leaf);
      int base_grad = leaf > 0 ? get_truth(base, s_requires_grad) : 0;
      Py_DECREF(base);
      if (leaf < 0 || base_grad < 0) return NULL;
      if (leaf && base_grad) goto as_it_is;
    } else {
      Py_DECREF(base);
    }
  }
  /* Set with `strided` by configure_hooks: without it the layout check
   * above has returned already. */
  PyObject* storage = PyObject_CallFunctionObjArgs(c->storage_fn, tensor, NULL);
  if (storage == NULL) return NULL;
  PyObject* key = PyObject_CallMethodObjArgs(storage, s_data_ptr, NULL);
  if (key == NULL) {
    Py_DECREF(storage);
    return NULL;
  }
  if (!is_none(c->fixed)) {
    /* A parameter's or buffer's storage: the model's memory. */
    r = PySequence_Contains(c->fixed, key);
    if (r != 0) {
      Py_DECREF(storage);
      Py_DECREF(key);
      if (r < 0) return NULL;
      goto as_it_is;
    }
  }
  PyObject* saved = store_pack(c, tensor, key, storage);
  Py_DECREF(storage);
  Py_DECREF(key);
  return saved;
as_it_is:
  Py_INCREF(tensor);
  return tensor;
}

static PyObject* core_hook_unpack(PyObject* self, PyObject* saved) {
  if (Py_TYPE(saved) != SavedType) {
    Py_INCREF(saved);
    return saved;
  }
  return store_unpack((Core*)self, (Saved*)saved);
}

static PyObject* core_configure_hooks(PyObject* self, PyObject* args,
                                      PyObject* kwargs) {
  Core* c = (Core*)self;
  int cuda;
  Py_ssize_t index;
  long long min_bytes;
  PyObject *capturing, *strided, *fixed, *storage_fn;
  static char* names[] = {"cuda",    "device_index", "min_bytes", "capturing",
                          "strided", "fixed",        "storage",   NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "pnLOOOO", names, &cuda,
                                   &index, &min_bytes, &capturing, &strided,
                                   &fixed, &storage_fn))
    return NULL;
  if (!PyCallable_Check(storage_fn)) {
    PyErr_SetString(PyExc_TypeError, "storage must be callable");
    return NULL;
  }
  c->cuda = (char)cuda;
  c->device_index = index;
  c->min_bytes = min_bytes;
  Py_INCREF(capturing);
  set_slot(&c->capturing, capturing);
  Py_INCREF(strided);
  set_slot(&c->strided, strided);
  Py_INCREF(fixed);
  set_slot(&c->fixed, fixed);
  Py_INCREF(storage_fn);
  set_slot(&c->storage_fn, storage_fn);
  Py_RETURN_NONE;
}

/* ---- Core's object protocol. */

static PyObject* core_new(PyTypeObject* type, PyObject* args,
                          PyObject* kwargs) {
  (void)args;
  (void)kwargs;
  allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
  Core* c = (Core*)alloc(type, 0);
  if (c == NULL) return NULL;
  c->counters = (Counters*)PyType_GenericAlloc(CountersType, 0);
  c->groups = PyDict_New();
  c->order = PyList_New(0);
  c->by_position = PyList_New(0);
  c->unpacked = PyList_New(0);
  c->dying = PyList_New(0);
  c->device_index = -1;
  if (c->counters == NULL || c->groups == NULL || c->order == NULL ||
      c->by_position == NULL || c->unpacked == NULL || c->dying == NULL) {
    Py_DECREF(c);
    return NULL;
  }
  return (PyObject*)c;
}

static int core_traverse(PyObject* self, visitproc visit, void* arg) {
  Core* c = (Core*)self;
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(c->lock);
  Py_VISIT(c->acquire);
  Py_VISIT(c->release);
  Py_VISIT((PyObject*)c->counters);
  Py_VISIT(c->groups);
  Py_VISIT(c->order);
  Py_VISIT(c->by_position);
  Py_VISIT(c->unpacked);
  Py_VISIT(c->dying);
  Py_VISIT(c->recompute);
  Py_VISIT(c->capturing);
  Py_VISIT(c->strided);
  Py_VISIT(c->fixed);
  Py_VISIT(c->storage_fn);
  return 0;
}

static int core_clear(PyObject* self) {
  Core* c = (Core*)self;
  Py_CLEAR(c->lock);
  Py_CLEAR(c->acquire);
  Py_CLEAR(c->release);
  Py_CLEAR(c->counters);
  Py_CLEAR(c->groups);
  Py_CLEAR(c->order);
  Py_CLEAR(c->by_position);
  Py_CLEAR(c->unpacked);
  Py_CLEAR(c->dying);
  Py_CLEAR(c->recompute);
  Py_CLEAR(c->capturing);
  Py_CLEAR(c->strided);
  Py_CLEAR(c->fixed);
  Py_CLEAR(c->storage_fn);
  return 0;
}

static void core_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  core_clear(self);
  free_self(self);
}

static PyObject* core_get_lock(PyObject* self, void* closure) {
  (void)closure;
  Core* c = (Core*)self;
  if (c->lock == NULL) Py_RETURN_NONE;
  Py_INCREF(c->lock);
  return c->lock;
}

/* The store's lock, with its bound acquire and release kept for the hot
 * path. */
static int core_set_lock(PyObject* self, PyObject* lock, void* closure) {
  (void)closure;
  Core* c = (Core*)self;
  if (lock == NULL) {
    PyErr_SetString(PyExc_AttributeError, "the lock cannot be deleted");
    return -1;
  }
  PyObject* acquire = PyObject_GetAttr(lock, s_acquire);
  if (acquire == NULL) return -1;
  PyObject* release = PyObject_GetAttr(lock, s_release);
  if (release == NULL) {
    Py_DECREF(acquire);
    return -1;
  }
  Py_INCREF(lock);
  set_slot(&c->lock, lock);
  set_slot(&c->acquire, acquire);
  set_slot(&c->release, release);
  return 0;
}

static PyGetSetDef core_getset[] = {
    {"lock", core_get_lock, core_set_lock,
     "The re-entrant lock that guards the store's state.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMemberDef core_members[] = {
    {"counters", T_OBJECT, offsetof(Core, counters), READONLY, NULL},
    OBJ(Core, groups),
    OBJ(Core, order),
    OBJ(Core, by_position),
    OBJ(Core, unpacked),
    OBJ(Core, dying),
    OBJ(Core, recompute),
    SSIZE(Core, alive),
    {"budget", T_LONGLONG, offsetof(Core, budget), 0, NULL},
    BOOL(Core, busy),
    {NULL, 0, 0, 0, NULL}};

static PyMethodDef core_methods[] = {
    {"pack", core_pack, METH_VARARGS,
     "pack(tensor, key, storage): records `tensor`, whose storage (at "
     "`key`) the hook looked up; returns its SavedTensor."},
    {"unpack", core_unpack, METH_O, "unpack(saved): the saved tensor."},
    {"_member_died", core_member_died, METH_VARARGS,
     "_member_died(group, index): a SavedTensor of `group` died."},
    {"hook_pack", core_hook_pack, METH_O,
     "The saved-tensor pack hook (see configure_hooks)."},
    {"hook_unpack", core_hook_unpack, METH_O, "The saved-tensor unpack hook."},
    {"configure_hooks", (PyCFunction)(void (*)(void))core_configure_hooks,
     METH_VARARGS | METH_KEYWORDS,
     "configure_hooks(cuda, device_index, min_bytes, capturing, strided, "
     "fixed, storage): what hook_pack keeps: tensors on this device "
     "(capturing(): whether a CUDA graph is being captured, or None), of "
     "layout `strided`, of at least min_bytes, whose storage "
     "(storage(tensor).data_ptr()) is not in `fixed` (None: no model; "
     "leaves that need grad and their views are left out)."},
    {NULL, NULL, 0, NULL}};

static PyType_Slot core_slots[] = {
    {Py_tp_doc,
     "The saved-tensor store's hot state and hooks; deltad.saved.SavedStore "
     "adds the rest."},
    {Py_tp_new, core_new},
    {Py_tp_traverse, core_traverse},
    {Py_tp_clear, core_clear},
    {Py_tp_dealloc, core_dealloc},
    {Py_tp_members, core_members},
    {Py_tp_getset, core_getset},
    {Py_tp_methods, core_methods},
    {0, NULL}};
static PyType_Spec core_spec = {
    "deltad._savedcore.Core", sizeof(Core), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, core_slots};

/* ---- The module. */

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "deltad._savedcore",
    "The saved-tensor store's hot path (see deltad.saved).",
    -1,
    NULL,
    NULL,
    NULL,
    NULL,
    NULL};

static int intern(PyObject** slot, const char* name) {
  *slot = PyUnicode_InternFromString(name);
  return *slot == NULL ? -1 : 0;
}

static int add_type(PyObject* module, PyTypeObject** slot, PyType_Spec* spec,
                    const char* name) {
  *slot = (PyTypeObject*)PyType_FromSpec(spec);
  if (*slot == NULL) return -1;
  Py_INCREF(*slot);
  if (PyModule_AddObject(module, name, (PyObject*)*slot) < 0) {
    Py_DECREF(*slot);
    return -1;
  }
  return 0;
}

PyMODINIT_FUNC PyInit__savedcore(void) {
  PyObject* m = PyModule_Create(&module_def);
  if (m == NULL) return NULL;
  if (intern(&RESIDENT, "resident") < 0 ||
      intern(&OFFLOADED, "offloaded") < 0 || intern(&EVICTED, "evicted") < 0 ||
      intern(&s_version, "_version") < 0 || intern(&s_is_cuda, "is_cuda") < 0 ||
      intern(&s_get_device, "get_device") < 0 ||
      intern(&s_layout, "layout") < 0 || intern(&s_numel, "numel") < 0 ||
      intern(&s_element_size, "element_size") < 0 ||
      intern(&s_requires_grad, "requires_grad") < 0 ||
      intern(&s_is_leaf, "is_leaf") < 0 || intern(&s_base, "_base") < 0 ||
      intern(&s_data_ptr, "data_ptr") < 0 || intern(&s_nbytes, "nbytes") < 0 ||
      intern(&s_calls, "calls") < 0 || intern(&s_acquire, "acquire") < 0 ||
      intern(&s_release, "release") < 0 ||
      intern(&s_new_iteration, "_new_iteration") < 0 ||
      intern(&s_pack_over_budget, "_pack_over_budget") < 0 ||
      intern(&s_unpack_slow, "_unpack_slow") < 0 ||
      intern(&s_check_version, "_check_version") < 0 ||
      intern(&s_drop, "_drop") < 0)
    goto error;
  if (add_type(m, &CountersType, &counters_spec, "Counters") < 0 ||
      add_type(m, &GroupType, &group_spec, "Group") < 0 ||
      add_type(m, &SavedType, &saved_spec, "SavedTensor") < 0 ||
      add_type(m, &CoreType, &core_spec, "Core") < 0)
    goto error;
  Py_INCREF(RESIDENT);
  Py_INCREF(OFFLOADED);
  Py_INCREF(EVICTED);
  if (PyModule_AddObject(m, "RESIDENT", RESIDENT) < 0 ||
      PyModule_AddObject(m, "OFFLOADED", OFFLOADED) < 0 ||
      PyModule_AddObject(m, "EVICTED", EVICTED) < 0)
    goto error;
  return m;
error:
  Py_DECREF(m);
  return NULL;
}
