/* What the C files of deltad._savedcore share: the types' layouts, the
 * module's types and interned names, and the functions one file calls in
 * another (_savedcore.c says why the hot path is in C and how it locks).
 *   _savedcore_types.c  Counters, Group and SavedTensor;
 *   _savedcore_store.c  Core's pack, unpack and a member's death;
 *   _savedcore_hooks.c  the saved-tensor hooks over them;
 *   _savedcore.c        Core's object protocol and the module. */

#ifndef DELTAD_SAVEDCORE_H_
#define DELTAD_SAVEDCORE_H_

#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

extern PyTypeObject *CountersType, *GroupType, *SavedType, *KeptType, *CoreType;
extern PyObject *RESIDENT, *OFFLOADED, *EVICTED;
/* Interned names. */
extern PyObject *s_version, *s_is_cuda, *s_get_device, *s_layout, *s_numel,
    *s_element_size, *s_requires_grad, *s_is_leaf, *s_base, *s_data_ptr,
    *s_nbytes, *s_calls, *s_acquire, *s_release, *s_new_iteration,
    *s_pack_over_budget, *s_unpack_slow, *s_check_version, *s_drop, *s_detach,
    *s_kept_changed;

static inline int is_none(PyObject* o) { return o == NULL || o == Py_None; }

/* Replaces *slot with `value` (a new reference, or NULL for None). */
static inline void set_slot(PyObject** slot, PyObject* value) {
  PyObject* old = *slot;
  *slot = value;
  Py_XDECREF(old);
}

/* An attribute or a method's result as a long long (-1: the error set). */
static inline int get_ll(PyObject* obj, PyObject* name, long long* out) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == NULL) return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static inline int call_ll(PyObject* obj, PyObject* name, long long* out) {
  PyObject* v = PyObject_CallMethodObjArgs(obj, name, NULL);
  if (v == NULL) return -1;
  *out = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* 1, 0, or -1 on error. */
static inline int get_truth(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == NULL) return -1;
  int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  return r;
}

static inline void free_self(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
  tp_free(self);
  Py_DECREF(tp);
}

#define OBJ(type, name) \
  { #name, T_OBJECT, offsetof(type, name), 0, NULL }
#define SSIZE(type, name) \
  { #name, T_PYSSIZET, offsetof(type, name), 0, NULL }
#define BOOL(type, name) \
  { #name, T_BOOL, offsetof(type, name), 0, NULL }

/* Counters: what the store did (ints, read without the lock). */
typedef struct {
  PyObject_HEAD long long saved_tensors, saved_groups, resident_bytes,
      peak_resident_bytes, host_bytes, offloads, offloaded_bytes, reloads,
      reloaded_bytes, prefetches, evictions, recomputes, recompute_ns,
      host_waits, stall_ns, overshoots, host_full;
} Counters;

/* Group: one storage's bytes and the saved tensors that view them. Its
 * fields are saved.py's (see _Group's description there). */
typedef struct {
  PyObject_HEAD PyObject *store, *key, *state, *tensors, *origins, *metas,
      *host, *flat, *event, *stream, *call, *retained, *evicted_sources,
      *versions;
  /* first_pack: the store's saved_tensors count at the pack that made it
   * (deltad.recompute finds it again in a rerun of its call by that). */
  Py_ssize_t nbytes, position, live, dependents, first_pack;
  char used, rebuilt;
} Group;

/* Core: the store's hot state and its hooks. */
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

/* SavedTensor: what autograd keeps instead of a saved tensor. */
typedef struct {
  PyObject_HEAD PyObject* group;
  Py_ssize_t index;
  long long version;
} Saved;

/* Kept: a saved tensor the store hands back as it is (a parameter, a
 * small tensor), with its version when saved: without hooks autograd
 * raises when such a tensor was changed in place since, and so must the
 * unpack hook. */
typedef struct {
  PyObject_HEAD PyObject* tensor;
  long long version;
} Kept;

/* _savedcore_types.c */
extern PyType_Spec counters_spec, group_spec, saved_spec, kept_spec;
PyObject* kept_create(PyObject* tensor, long long version);
Group* group_create(PyObject* store, PyObject* key, Py_ssize_t nbytes,
                    Py_ssize_t position, PyObject* call);
PyObject* saved_create(Group* group, Py_ssize_t index, long long version);

/* _savedcore_store.c */
extern PyMethodDef core_methods[];
int member_died(Core* core, Group* group, Py_ssize_t index);
PyObject* store_pack(Core* c, PyObject* tensor, PyObject* key,
                     PyObject* storage);
PyObject* store_unpack(Core* c, Saved* s);

/* _savedcore_hooks.c */
PyObject* core_hook_pack(PyObject* self, PyObject* tensor);
PyObject* core_hook_unpack(PyObject* self, PyObject* saved);
PyObject* core_configure_hooks(PyObject* self, PyObject* args,
                               PyObject* kwargs);

#endif /* DELTAD_SAVEDCORE_H_ */
