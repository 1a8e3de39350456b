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

#include "_savedcore.h"

PyTypeObject *CountersType, *GroupType, *SavedType, *KeptType, *CoreType;
PyObject *RESIDENT, *OFFLOADED, *EVICTED;
PyObject *s_version, *s_is_cuda, *s_get_device, *s_layout, *s_numel,
    *s_element_size, *s_requires_grad, *s_is_leaf, *s_base, *s_data_ptr,
    *s_nbytes, *s_calls, *s_acquire, *s_release, *s_new_iteration,
    *s_pack_over_budget, *s_unpack_slow, *s_check_version, *s_drop, *s_detach,
    *s_kept_changed;

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
      intern(&s_drop, "_drop") < 0 || intern(&s_detach, "detach") < 0 ||
      intern(&s_kept_changed, "_kept_changed") < 0)
    goto error;
  if (add_type(m, &CountersType, &counters_spec, "Counters") < 0 ||
      add_type(m, &GroupType, &group_spec, "Group") < 0 ||
      add_type(m, &SavedType, &saved_spec, "SavedTensor") < 0 ||
      add_type(m, &KeptType, &kept_spec, "Kept") < 0 ||
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
