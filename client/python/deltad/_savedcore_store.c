/* deltad._savedcore's Core: the store's pack and unpack and a member's
 * death (_savedcore.c says why in C; _savedcore_hooks.c the hooks). */

#include "_savedcore.h"

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

/* 1 if autograd made `tensor` (it requires grad and is no leaf: it has a
 * grad_fn), 0 if not, -1 on error. */
static int autograd_made(PyObject* tensor) {
  int r = get_truth(tensor, s_requires_grad);
  if (r <= 0) return r;
  r = get_truth(tensor, s_is_leaf);
  return r < 0 ? -1 : !r;
}

/* What a group keeps of a saved tensor (*kept) and how _releasable tells
 * whether its caller still holds it (*origin), both new references.
 * Autograd's node for a tensor it made may save that very tensor (ReLU
 * saves its result): keeping the tensor itself, whose grad_fn is that
 * node, which holds the SavedTensor, which holds the group, would close a
 * cycle through the C++ graph that Python's collector cannot see, and a
 * graph dropped without backward (a step that failed, an evaluation with
 * grad enabled) would hold its memory for good. So such a tensor is kept
 * as a detached alias (the same storage and version counter, no grad_fn;
 * autograd gives the unpacked tensor its grad_fn either way), *origin
 * being (weakref to the tensor, weakref to its base or None). Any other
 * is kept as it is, *origin None. 0, or -1 with an error. */
static int keep_member(PyObject* tensor, PyObject** kept, PyObject** origin) {
  *kept = *origin = NULL;
  int made = autograd_made(tensor);
  if (made < 0) return -1;
  if (!made) {
    Py_INCREF(tensor);
    *kept = tensor;
    Py_INCREF(Py_None);
    *origin = Py_None;
    return 0;
  }
  PyObject* base = PyObject_GetAttr(tensor, s_base);
  if (base == NULL) return -1;
  PyObject* self_ref = PyWeakref_NewRef(tensor, NULL);
  PyObject* base_ref = NULL;
  if (self_ref != NULL) {
    if (base == Py_None) {
      Py_INCREF(Py_None);
      base_ref = Py_None;
    } else {
      base_ref = PyWeakref_NewRef(base, NULL);
    }
  }
  Py_DECREF(base);
  if (base_ref != NULL) {
    *origin = PyTuple_Pack(2, self_ref, base_ref);
    if (*origin != NULL)
      *kept = PyObject_CallMethodObjArgs(tensor, s_detach, NULL);
  }
  Py_XDECREF(self_ref);
  Py_XDECREF(base_ref);
  if (*kept == NULL) {
    Py_CLEAR(*origin);
    return -1;
  }
  return 0;
}

/* Appends a member to a group: what keep_member keeps of `tensor`, at
 * index *index of both tensors and origins. 0, or -1 with an error (the
 * group as it was). */
static int add_member(Group* g, PyObject* tensor, Py_ssize_t* index) {
  if (check_list(g->tensors, "group's tensors") < 0 ||
      check_list(g->origins, "group's origins") < 0)
    return -1;
  if (PyList_Size(g->origins) != PyList_Size(g->tensors)) {
    PyErr_SetString(PyExc_RuntimeError,
                    "deltad: a group's origins do not match its tensors");
    return -1;
  }
  PyObject *kept, *origin;
  if (keep_member(tensor, &kept, &origin) < 0) return -1;
  *index = PyList_Size(g->tensors);
  int rc = PyList_Append(g->tensors, kept);
  if (rc == 0 && PyList_Append(g->origins, origin) < 0) {
    (void)PyList_SetSlice(g->tensors, *index, *index + 1, NULL);
    rc = -1;
  }
  Py_DECREF(kept);
  Py_DECREF(origin);
  return rc;
}

/* Forgets member `index` of a group (autograd let go of it, or it could
 * not be saved after all). */
static int forget_member(Group* g, Py_ssize_t index) {
  Py_INCREF(Py_None);
  if (PyList_SetItem(g->tensors, index, Py_None) < 0) return -1;
  if (g->origins != NULL && PyList_Check(g->origins) &&
      index < PyList_Size(g->origins)) {
    Py_INCREF(Py_None);
    if (PyList_SetItem(g->origins, index, Py_None) < 0) return -1;
  }
  return 0;
}

/* ---- Core: pack, unpack, a member's death. */

/* Undoes a new group's registration when its pack fails: out of `groups`,
 * `order` and `by_position` (where it is the last entry) and not alive.
 * Keeps the pending error. */
static void unregister_group(Core* c, Group* g) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  if (PyDict_Check(c->groups)) {
    PyObject* found = PyDict_GetItemWithError(c->groups, g->key);
    if (found == (PyObject*)g && PyDict_DelItem(c->groups, g->key) < 0)
      PyErr_Clear();
    PyErr_Clear();
  }
  PyObject* lists[] = {c->order, c->by_position};
  for (int i = 0; i < 2; ++i) {
    if (lists[i] == NULL || !PyList_Check(lists[i])) continue;
    const Py_ssize_t n = PyList_Size(lists[i]);
    if (n > 0 && PyList_GetItem(lists[i], n - 1) == (PyObject*)g &&
        PyList_SetSlice(lists[i], n - 1, n, NULL) < 0)
      PyErr_Clear();
  }
  c->alive--;
  PyErr_Restore(type, value, traceback);
}

PyObject* store_pack(Core* c, PyObject* tensor, PyObject* key,
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
    /* Another view of a storage saved already. The allocations below may
     * run the collector, and with it the death of this group's last
     * SavedTensor, which would drop the group under the new member: such
     * deaths wait until it has joined (member_died defers them while the
     * store is busy). */
    g = (Group*)found;
    Py_INCREF(g);
    const char busy = c->busy;
    c->busy = 1;
    Py_ssize_t index;
    if (get_ll(tensor, s_version, &version) == 0 &&
        add_member(g, tensor, &index) == 0) {
      g->live++;
      result = saved_create(g, index, version);
      if (result == NULL) {
        /* Not saved after all: the group is as it was. */
        g->live--;
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (forget_member(g, index) < 0) PyErr_Clear();
        PyErr_Restore(type, value, traceback);
      }
    }
    c->busy = busy;
    if (!busy && c->dying != NULL && PyList_Check(c->dying) &&
        PyList_Size(c->dying) > 0) {
      /* The deaths deferred meanwhile, now (saved.py's _done). */
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);
      PyObject* r = PyObject_CallMethod((PyObject*)c, "_done", "O", Py_False);
      if (r == NULL) {
        Py_CLEAR(result);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
      } else {
        Py_DECREF(r);
        PyErr_Restore(type, value, traceback);
      }
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
  /* Held: the allocations in group_create may run the collector, and with
   * it the finalizer that takes the call out of `calls` (its last
   * reference, when the tensor that returned it died). */
  Py_INCREF(call);
  if (check_list(c->by_position, "by_position") < 0 ||
      check_list(c->order, "order") < 0) {
    Py_DECREF(call);
    Py_DECREF(calls);
    goto done;
  }
  g = group_create((PyObject*)c, key, (Py_ssize_t)nbytes,
                   PyList_Size(c->by_position), call);
  Py_DECREF(call);
  Py_DECREF(calls);
  if (g == NULL) goto done;
  g->first_pack = (Py_ssize_t)c->counters->saved_tensors;
  if (get_ll(tensor, s_version, &version) < 0) goto done;
  Py_ssize_t first;
  if (add_member(g, tensor, &first) < 0) goto done;
  g->live = 1;
  if (check_dict(c->groups) < 0 ||
      PyDict_SetItem(c->groups, key, (PyObject*)g) < 0)
    goto done;
  c->alive++;
  Counters* k = c->counters;
  PyObject* saved = NULL;
  if (PyList_Append(c->order, (PyObject*)g) == 0 &&
      PyList_Append(c->by_position, (PyObject*)g) == 0)
    saved = saved_create(g, 0, version);
  if (saved == NULL) {
    /* No SavedTensor holds the group, so no death would ever take it out
     * again, and the store would count a live group for good (no forward
     * would begin a new iteration). */
    unregister_group(c, g);
    goto done;
  }
  k->saved_groups++;
  k->resident_bytes += nbytes;
  if (k->resident_bytes > k->peak_resident_bytes) {
    /* Past the budget only until the release below. */
    k->peak_resident_bytes = k->resident_bytes;
  }
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

PyObject* store_unpack(Core* c, Saved* s) {
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
int member_died(Core* c, Group* g, Py_ssize_t index) {
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
  if (tensor != Py_None && forget_member(g, index) < 0) goto done;
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
    set_slot(&g->origins, NULL);
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

PyMethodDef core_methods[] = {
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
