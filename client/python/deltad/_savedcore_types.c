/* deltad._savedcore's data types: Counters, Group and SavedTensor. */

#include "_savedcore.h"

/* ---- Counters: what the store did (ints, read without the lock). */

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

/* Zeros them: a store reused by the next block counts that block's work. */
static PyObject* counters_reset(PyObject* self, PyObject* unused) {
  (void)unused;
  const size_t head = offsetof(Counters, saved_tensors);
  memset((char*)self + head, 0, sizeof(Counters) - head);
  Py_RETURN_NONE;
}

static PyMethodDef counters_methods[] = {
    {"snapshot", counters_snapshot, METH_NOARGS,
     "A copy of the counters as they are now."},
    {"reset", counters_reset, METH_NOARGS, "Sets every counter to 0."},
    {NULL, NULL, 0, NULL}};

static PyType_Slot counters_slots[] = {
    {Py_tp_doc, "What the store did; ints, read without the lock."},
    {Py_tp_members, counters_members},
    {Py_tp_methods, counters_methods},
    {Py_tp_new, PyType_GenericNew},
    {0, NULL}};
PyType_Spec counters_spec = {"deltad._savedcore.Counters", sizeof(Counters), 0,
                             Py_TPFLAGS_DEFAULT, counters_slots};

/* ---- Group: one storage's bytes and the saved tensors that view them.
 * Its fields are saved.py's (see _Group's description there). */

Group* group_create(PyObject* store, PyObject* key, Py_ssize_t nbytes,
                    Py_ssize_t position, PyObject* call) {
  Group* g = (Group*)PyType_GenericAlloc(GroupType, 0);
  if (g == NULL) return NULL;
  g->tensors = PyList_New(0);
  g->origins = PyList_New(0);
  g->evicted_sources = PyTuple_New(0);
  if (g->tensors == NULL || g->origins == NULL || g->evicted_sources == NULL) {
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
  Py_VISIT(g->origins);
  Py_VISIT(g->metas);
  Py_VISIT(g->host);
  Py_VISIT(g->flat);
  Py_VISIT(g->event);
  Py_VISIT(g->stream);
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
  Py_CLEAR(g->origins);
  Py_CLEAR(g->metas);
  Py_CLEAR(g->host);
  Py_CLEAR(g->flat);
  Py_CLEAR(g->event);
  Py_CLEAR(g->stream);
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

static PyMemberDef group_members[] = {OBJ(Group, store),
                                      OBJ(Group, key),
                                      OBJ(Group, state),
                                      OBJ(Group, tensors),
                                      OBJ(Group, origins),
                                      OBJ(Group, metas),
                                      OBJ(Group, host),
                                      OBJ(Group, flat),
                                      OBJ(Group, event),
                                      OBJ(Group, stream),
                                      OBJ(Group, call),
                                      OBJ(Group, retained),
                                      OBJ(Group, evicted_sources),
                                      OBJ(Group, versions),
                                      SSIZE(Group, nbytes),
                                      SSIZE(Group, position),
                                      SSIZE(Group, first_pack),
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
PyType_Spec group_spec = {"deltad._savedcore.Group", sizeof(Group), 0,
                          Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, group_slots};

/* ---- SavedTensor: what autograd keeps instead of a saved tensor. Not
 * tracked by the garbage collector: nothing it references can refer back
 * to it. */

PyObject* saved_create(Group* group, Py_ssize_t index, long long version) {
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
PyType_Spec saved_spec = {"deltad._savedcore.SavedTensor", sizeof(Saved), 0,
                          Py_TPFLAGS_DEFAULT, saved_slots};

/* ---- Kept: a saved tensor handed back as it is, with its version. Not
 * tracked by the garbage collector: what it holds is a parameter, a
 * tensor autograd did not make, or a detached alias, none of which can
 * refer back to it. */

PyObject* kept_create(PyObject* tensor, long long version) {
  Kept* k = (Kept*)PyType_GenericAlloc(KeptType, 0);
  if (k == NULL) return NULL;
  Py_INCREF(tensor);
  k->tensor = tensor;
  k->version = version;
  return (PyObject*)k;
}

static void kept_dealloc(PyObject* self) {
  Py_CLEAR(((Kept*)self)->tensor);
  free_self(self);
}

static PyMemberDef kept_members[] = {
    {"tensor", T_OBJECT, offsetof(Kept, tensor), READONLY, NULL},
    {"version", T_LONGLONG, offsetof(Kept, version), READONLY, NULL},
    {NULL, 0, 0, 0, NULL}};

static PyType_Slot kept_slots[] = {
    {Py_tp_doc,
     "A saved tensor the store hands back as it is, and its version when "
     "saved (the unpack hook raises if it changed in place since)."},
    {Py_tp_members, kept_members},
    {Py_tp_dealloc, kept_dealloc},
    {0, NULL}};
PyType_Spec kept_spec = {"deltad._savedcore.Kept", sizeof(Kept), 0,
                         Py_TPFLAGS_DEFAULT, kept_slots};
