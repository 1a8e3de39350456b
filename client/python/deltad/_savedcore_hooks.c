/* deltad._savedcore's saved-tensor hooks: which tensors the store keeps,
 * and what autograd gets back (_savedcore.c says why in C). */

#include "_savedcore.h"

/* The pack hook: what the store keeps (a SavedTensor), or the tensor as it
 * is when it is not the store's (another device, sparse, small, a
 * parameter's storage, or a CUDA graph being captured). */
PyObject* core_hook_pack(PyObject* self, PyObject* tensor) {
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
as_it_is:;
  /* Without hooks autograd raises at unpack for a saved tensor changed in
   * place since; handed back as it is, its version is kept to check.
   * Only for tensors that need grad (parameters, activations): autograd
   * does not check a BatchNorm's running statistics, which the next
   * forward (and a rebuild's restore) update in place. */
  r = get_truth(tensor, s_requires_grad);
  if (r < 0) return NULL;
  if (!r) {
    Py_INCREF(tensor);
    return tensor;
  }
  /* Detached for the reason keep_member gives (an alias: the same version
   * counter). */
  r = get_truth(tensor, s_is_leaf);
  if (r < 0) return NULL;
  PyObject* kept = r ? (Py_INCREF(tensor), tensor)
                     : PyObject_CallMethodObjArgs(tensor, s_detach, NULL);
  if (kept == NULL) return NULL;
  long long version;
  PyObject* result = NULL;
  if (get_ll(kept, s_version, &version) == 0) {
    result = kept_create(kept, version);
  }
  Py_DECREF(kept);
  return result;
}

PyObject* core_hook_unpack(PyObject* self, PyObject* saved) {
  if (Py_TYPE(saved) == KeptType) {
    Kept* k = (Kept*)saved;
    long long version;
    if (get_ll(k->tensor, s_version, &version) < 0) return NULL;
    if (version != k->version) {
      /* Raises as autograd does without hooks (saved.py words it). */
      PyObject* v = PyLong_FromLongLong(k->version);
      if (v == NULL) return NULL;
      PyObject* r =
          PyObject_CallMethodObjArgs(self, s_kept_changed, k->tensor, v, NULL);
      Py_DECREF(v);
      Py_XDECREF(r);
      if (r != NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "deltad: a saved tensor was modified in place");
      }
      return NULL;
    }
    Py_INCREF(k->tensor);
    return k->tensor;
  }
  if (Py_TYPE(saved) != SavedType) {
    Py_INCREF(saved);
    return saved;
  }
  return store_unpack((Core*)self, (Saved*)saved);
}

PyObject* core_configure_hooks(PyObject* self, PyObject* args,
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
