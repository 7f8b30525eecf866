/*
 * gymckpt.store._exact: the records codec's two exactness walks, in C.
 *
 * Optional: gymckpt/store/_walks.py has the same walks in Python and uses them when this
 * module is not built (no C compiler at install) or GYMCKPT_PURE_PYTHON=1. Both answer
 * the same for every value orjson accepts; tests/store/test_codec_accelerator.py compares them.
 *
 * fast_path_safe(value) -> bool
 *     True when value holds only exact dict (str keys), list, str, int within
 *     [-2**63, 2**64 - 1], finite float, bool and None, nested at most MAX_LEVELS deep:
 *     what orjson writes exactly.
 * with_fragments(value) -> object | None
 *     value with NaN, +/-Infinity and integers beyond 64 bits replaced by orjson
 *     Fragments (value itself when it holds none, else copies of the containers on the way
 *     to them); None when it holds any other type or nests deeper than MAX_LEVELS.
 * configure(nan, inf, ninf, big_int) -> None
 *     The fragments with_fragments puts in place, and the callable that makes one of an int.
 *
 * fast_path_safe allocates nothing and runs no Python code. with_fragments holds a reference
 * to every container and item it is looking at, so code run meanwhile (the big_int callable,
 * a collection) cannot free them under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* orjson writes at most this many nested containers (the record itself is one) */
#define MAX_LEVELS 254

static PyObject *nan_fragment = NULL;
static PyObject *inf_fragment = NULL;
static PyObject *ninf_fragment = NULL;
static PyObject *big_int_fragment = NULL;
static PyObject *uint64_max = NULL;

/* 1 when orjson writes the (exact) int: -2**63 <= number <= 2**64 - 1; 0 otherwise, never an error */
static inline int
int_fits(PyObject *number)
{
    /* most ints are small: one or two digits hold at most 60 bits */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)number)) {
        return 1;
    }
#else
    if (Py_SIZE(number) >= -2 && Py_SIZE(number) <= 2) {
        return 1;
    }
#endif
    int overflow = 0;
    (void)PyLong_AsLongLongAndOverflow(number, &overflow);
    if (overflow == 0) {
        return 1;
    }
    if (overflow < 0) {
        return 0;
    }
    /* above 2**63 - 1: comparing two ints allocates nothing and cannot fail */
    return PyObject_RichCompareBool(number, uint64_max, Py_LE) == 1;
}

static int fast_container(PyObject *node, int level);

/* 1 when orjson writes item exactly; item sits in a container at level */
static inline int
fast_item(PyObject *item, int level)
{
    PyTypeObject *type = Py_TYPE(item);
    /* numbers first: most of a record's items are (token ids, logprobs) */
    if (type == &PyFloat_Type) {
        return isfinite(PyFloat_AS_DOUBLE(item)) ? 1 : 0;
    }
    if (type == &PyLong_Type) {
        return int_fits(item);
    }
    if (type == &PyUnicode_Type || item == Py_None || type == &PyBool_Type) {
        return 1;
    }
    if (type == &PyDict_Type || type == &PyList_Type) {
        return fast_container(item, level + 1);
    }
    return 0;
}

static int
fast_container(PyObject *node, int level)
{
    if (level > MAX_LEVELS) {
        return 0;
    }
    if (Py_TYPE(node) == &PyDict_Type) {
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (PyDict_Next(node, &position, &key, &value)) {
            if (Py_TYPE(key) != &PyUnicode_Type || !fast_item(value, level)) {
                return 0;
            }
        }
        return 1;
    }
    for (Py_ssize_t index = 0; index < PyList_GET_SIZE(node); index++) {
        if (!fast_item(PyList_GET_ITEM(node, index), level)) {
            return 0;
        }
    }
    return 1;
}

static PyObject *
fast_path_safe(PyObject *module, PyObject *value)
{
    (void)module;
    return PyBool_FromLong(fast_item(value, 0));
}

/* with_fragments' walk: 1 and *out (a new reference: item itself or its replacement),
 * 0 when item is refused, -1 on an error (set) */
static int fragment_container(PyObject *node, int level, PyObject **out);

static int
fragment_item(PyObject *item, int level, PyObject **out)
{
    PyTypeObject *type = Py_TYPE(item);
    if (type == &PyUnicode_Type || item == Py_None || type == &PyBool_Type) {
        *out = Py_NewRef(item);
        return 1;
    }
    if (type == &PyLong_Type) {
        if (int_fits(item)) {
            *out = Py_NewRef(item);
            return 1;
        }
        *out = PyObject_CallOneArg(big_int_fragment, item);
        return *out == NULL ? -1 : 1;
    }
    if (type == &PyFloat_Type) {
        double number = PyFloat_AS_DOUBLE(item);
        if (isfinite(number)) {
            *out = Py_NewRef(item);
        }
        else if (isnan(number)) {
            *out = Py_NewRef(nan_fragment);
        }
        else {
            *out = Py_NewRef(number > 0 ? inf_fragment : ninf_fragment);
        }
        return 1;
    }
    if (type == &PyDict_Type || type == &PyList_Type) {
        return fragment_container(item, level + 1, out);
    }
    return 0;
}

/* a container that changes size while it is walked (code run by big_int, another thread) is an error */
static int
changed_size(const char *what)
{
    PyErr_Format(PyExc_RuntimeError, "%s changed size while the record was encoded", what);
    return -1;
}

static int
fragment_dict(PyObject *node, int level, PyObject **out)
{
    const Py_ssize_t size = PyDict_GET_SIZE(node);
    PyObject *copy = NULL;
    Py_ssize_t position = 0;
    PyObject *key, *value;
    while (PyDict_Next(node, &position, &key, &value)) {
        if (Py_TYPE(key) != &PyUnicode_Type) {
            Py_XDECREF(copy);
            return 0;
        }
        Py_INCREF(key);
        Py_INCREF(value);
        PyObject *replaced = NULL;
        int found = fragment_item(value, level, &replaced);
        if (found > 0 && PyDict_GET_SIZE(node) != size) {
            found = changed_size("a dict");
        }
        if (found > 0 && replaced != value) {
            /* the first change copies the dict: setting a key it holds keeps the key's place */
            if (copy == NULL) {
                copy = PyDict_Copy(node);
            }
            if (copy == NULL || PyDict_SetItem(copy, key, replaced) < 0) {
                found = -1;
            }
        }
        Py_XDECREF(replaced);
        Py_DECREF(value);
        Py_DECREF(key);
        if (found <= 0) {
            Py_XDECREF(copy);
            return found;
        }
    }
    *out = copy != NULL ? copy : Py_NewRef(node);
    return 1;
}

static int
fragment_list(PyObject *node, int level, PyObject **out)
{
    const Py_ssize_t size = PyList_GET_SIZE(node);
    PyObject *copy = NULL;
    for (Py_ssize_t index = 0; index < size; index++) {
        if (PyList_GET_SIZE(node) != size) {
            Py_XDECREF(copy);
            return changed_size("a list");
        }
        PyObject *item = Py_NewRef(PyList_GET_ITEM(node, index));
        PyObject *replaced = NULL;
        int found = fragment_item(item, level, &replaced);
        if (found > 0 && replaced != item) {
            /* the first change copies the list, of the size it had when the walk began */
            if (copy == NULL && PyList_GET_SIZE(node) == size) {
                copy = PyList_GetSlice(node, 0, size);
                found = copy == NULL ? -1 : found;
            }
            else if (copy == NULL) {
                found = changed_size("a list");
            }
            if (found > 0) {
                PyObject *old = PyList_GET_ITEM(copy, index);
                PyList_SET_ITEM(copy, index, replaced); /* steals replaced */
                Py_DECREF(old);
                replaced = NULL;
            }
        }
        Py_XDECREF(replaced);
        Py_DECREF(item);
        if (found <= 0) {
            Py_XDECREF(copy);
            return found;
        }
    }
    *out = copy != NULL ? copy : Py_NewRef(node);
    return 1;
}

static int
fragment_container(PyObject *node, int level, PyObject **out)
{
    if (level > MAX_LEVELS) {
        return 0;
    }
    Py_INCREF(node);
    int found = Py_TYPE(node) == &PyDict_Type ? fragment_dict(node, level, out) : fragment_list(node, level, out);
    Py_DECREF(node);
    return found;
}

static PyObject *
with_fragments(PyObject *module, PyObject *value)
{
    (void)module;
    if (big_int_fragment == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gymckpt.store._exact.configure() was not called");
        return NULL;
    }
    PyObject *out = NULL;
    int found = fragment_item(value, 0, &out);
    if (found < 0) {
        return NULL;
    }
    if (found == 0) {
        Py_RETURN_NONE;
    }
    return out;
}

static PyObject *
configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "configure(nan, inf, ninf, big_int) takes 4 arguments");
        return NULL;
    }
    if (!PyCallable_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "configure: big_int must be callable");
        return NULL;
    }
    Py_XSETREF(nan_fragment, Py_NewRef(args[0]));
    Py_XSETREF(inf_fragment, Py_NewRef(args[1]));
    Py_XSETREF(ninf_fragment, Py_NewRef(args[2]));
    Py_XSETREF(big_int_fragment, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fast_path_safe", fast_path_safe, METH_O,
     "fast_path_safe(value) -> bool: True when orjson writes value exactly (exact JSON types, finite floats, "
     "64-bit ints, at most 254 levels)."},
    {"with_fragments", with_fragments, METH_O,
     "with_fragments(value) -> object | None: value with NaN, +/-Infinity and big ints as orjson Fragments; "
     "None when it holds another type or nests deeper than 254 levels."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(nan, inf, ninf, big_int) -> None: the fragments with_fragments uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "gymckpt.store._exact", "The records codec's exactness walks, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__exact(void)
{
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL) {
        return NULL;
    }
    if (uint64_max == NULL && (uint64_max = PyLong_FromUnsignedLongLong(0xFFFFFFFFFFFFFFFFULL)) == NULL) {
        Py_DECREF(module);
        return NULL;
    }
    if (PyModule_AddIntConstant(module, "MAX_LEVELS", MAX_LEVELS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
