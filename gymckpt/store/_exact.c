/*
 * gymckpt.store._exact: the records codec's exactness walk and exact encoder, in C.
 *
 * Optional: gymckpt/store/codec.py and _walks.py do the same in Python (the walk, and
 * json.dumps for the encoder) and use them when this module is not built (no C compiler at
 * install) or GYMCKPT_PURE_PYTHON=1; tests/store/test_codec_accelerator.py compares them.
 *
 * fast_path_safe(value) -> bool
 *     True when value holds only exact dict (str keys), list, str, int within
 *     [-2**63, 2**64 - 1], finite float, bool and None, nested at most MAX_LEVELS deep:
 *     what orjson writes exactly.
 * exact_line(value) -> bytes | None
 *     json.dumps(value, ensure_ascii=True, allow_nan=True, separators=(",", ": ")) plus a
 *     newline, byte for byte, for a value of exact JSON types (str keys) at most MAX_LEVELS
 *     deep without surrogate pairs or ints beyond the interpreter's digit limit; None for
 *     anything else (the Python path writes it or refuses it by name).
 *
 * encode_line(record) -> (episode_id, line) | None
 *     codec.encode_record's answer in one call (orjson.dumps, the fast walk, exact_line), for a
 *     record led by its episode_id; None where the Python code decides (and raises, if it must).
 *     configure_encoder(dumps, default, option) sets how it calls orjson.
 * append_lines(records, batch, filled, target, seen, ids[, longest]) -> (filled, ended, record[, longest])
 *     write_records' loop for the records encode_line writes: lines appended to a bytearray, ids
 *     to a set and a list, until a target size, the iterator's end, or a record left to Python;
 *     with longest, the longest line written so far too. Pre-encoded records (the type
 *     configure_encoded names) whose line passes encoded.check_encoded's look, and runs of them
 *     (encoded.EncodedRun) whose lines pass encoded.check_run's, are appended as they are; the
 *     others are left to Python.
 * note_run(run, seen, ids, longest) -> longest | None
 *     append_lines' look at a run of lines already in the file (appended there by their producer):
 *     ids noted, nothing copied.
 * decode_line(line) -> (episode_id, record) | None
 *     codec.decode_line_and_id's answer for a fast line whose id orjson writes without escapes
 *     and whose objects hold no key twice; None where the Python code decides.
 *     configure_decoder(loads) sets the orjson.loads it calls.
 * decode_lines(chunk, start, limit, ids[, line_limit]) -> (records, position)
 *     read_records' loop over the fast lines of a chunk: records decoded, ids appended, until a
 *     byte limit, a line left to Python (or longer than line_limit), or the last newline;
 *     position is where it stopped.
 *
 * The walk and exact_line run no Python code and allocate no container: borrowed references
 * stay valid.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* orjson writes at most this many nested containers (the record itself is one) */
#define MAX_LEVELS 254

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

/* ---- exact_line: json.dumps(value, ensure_ascii=True, allow_nan=True, separators=(",", ": ")) + "\n" ----
 *
 * Byte for byte what the standard library writes (gymckpt's exact lines before this module
 * existed, so a retried commit hashes the same): floats through PyOS_double_to_string as
 * float.__repr__ does, ints as int.__repr__, strings escaped as json's ensure_ascii does.
 * Each writer returns 1 (written), 0 (refused: left to the Python path, which writes it or
 * names what JSON cannot hold) or -1 (an error is set). No Python code runs meanwhile and
 * no container is changed, so borrowed references stay valid.
 */

typedef struct {
    PyObject *bytes; /* the line being written, over-allocated */
    char *data;
    Py_ssize_t size;
    Py_ssize_t capacity;
} Line;

static int
line_reserve(Line *line, Py_ssize_t extra)
{
    if (extra <= line->capacity - line->size) {
        return 0;
    }
    Py_ssize_t capacity = line->capacity;
    while (extra > capacity - line->size) {
        if (capacity > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        capacity *= 2;
    }
    if (_PyBytes_Resize(&line->bytes, capacity) < 0) {
        return -1; /* line->bytes is NULL now */
    }
    line->data = PyBytes_AS_STRING(line->bytes);
    line->capacity = capacity;
    return 0;
}

static inline int
line_write(Line *line, const char *text, Py_ssize_t length)
{
    if (line_reserve(line, length) < 0) {
        return -1;
    }
    memcpy(line->data + line->size, text, (size_t)length);
    line->size += length;
    return 1;
}

static const char hex_digits[] = "0123456789abcdef";

/* printable ASCII but the quote and the backslash: written as it is */
#define PLAIN(c) ((c) >= ' ' && (c) <= '~' && (c) != '\\' && (c) != '"')

static inline Py_ssize_t
escaped_length(Py_UCS4 c)
{
    if (PLAIN(c)) {
        return 1;
    }
    if (c == '\\' || c == '"' || c == '\b' || c == '\f' || c == '\n' || c == '\r' || c == '\t') {
        return 2;
    }
    return c >= 0x10000 ? 12 : 6;
}

static inline char *
write_u_escape(char *out, Py_UCS4 c)
{
    *out++ = '\\';
    *out++ = 'u';
    *out++ = hex_digits[(c >> 12) & 0xf];
    *out++ = hex_digits[(c >> 8) & 0xf];
    *out++ = hex_digits[(c >> 4) & 0xf];
    *out++ = hex_digits[c & 0xf];
    return out;
}

static inline char *
write_escaped(char *out, Py_UCS4 c)
{
    if (PLAIN(c)) {
        *out++ = (char)c;
        return out;
    }
    switch (c) {
    case '\\': *out++ = '\\'; *out++ = '\\'; return out;
    case '"': *out++ = '\\'; *out++ = '"'; return out;
    case '\b': *out++ = '\\'; *out++ = 'b'; return out;
    case '\f': *out++ = '\\'; *out++ = 'f'; return out;
    case '\n': *out++ = '\\'; *out++ = 'n'; return out;
    case '\r': *out++ = '\\'; *out++ = 'r'; return out;
    case '\t': *out++ = '\\'; *out++ = 't'; return out;
    default: break;
    }
    if (c >= 0x10000) { /* a UTF-16 surrogate pair, as json writes it */
        out = write_u_escape(out, Py_UNICODE_HIGH_SURROGATE(c));
        c = Py_UNICODE_LOW_SURROGATE(c);
    }
    return write_u_escape(out, c);
}

/* a string as json writes it with ensure_ascii; refused (0) when it holds a high surrogate followed
 * by a low one (two code points JSON would read back as one character) */
static int
write_string(Line *line, PyObject *text)
{
    const Py_ssize_t count = PyUnicode_GET_LENGTH(text);
    const int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t length = 2;
    if (PyUnicode_IS_ASCII(text)) {
        const Py_UCS1 *chars = (const Py_UCS1 *)data;
        for (Py_ssize_t index = 0; index < count; index++) {
            length += PLAIN(chars[index]) ? 1 : escaped_length(chars[index]);
        }
    }
    else {
        Py_UCS4 previous = 0;
        for (Py_ssize_t index = 0; index < count; index++) {
            Py_UCS4 c = PyUnicode_READ(kind, data, index);
            if (Py_UNICODE_IS_LOW_SURROGATE(c) && Py_UNICODE_IS_HIGH_SURROGATE(previous)) {
                return 0;
            }
            previous = c;
            length += escaped_length(c);
        }
    }
    if (line_reserve(line, length) < 0) {
        return -1;
    }
    char *out = line->data + line->size;
    *out++ = '"';
    if (length == count + 2) { /* nothing to escape */
        for (Py_ssize_t index = 0; index < count; index++) {
            *out++ = (char)PyUnicode_READ(kind, data, index);
        }
    }
    else {
        for (Py_ssize_t index = 0; index < count; index++) {
            out = write_escaped(out, PyUnicode_READ(kind, data, index));
        }
    }
    *out++ = '"';
    line->size += length;
    return 1;
}

static int
write_int(Line *line, PyObject *number)
{
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (overflow == 0) {
        if (value == -1 && PyErr_Occurred()) {
            return -1;
        }
        char digits[24];
        char *end = digits + sizeof(digits);
        char *start = end;
        unsigned long long rest = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
        do {
            *--start = (char)('0' + rest % 10);
            rest /= 10;
        } while (rest);
        if (value < 0) {
            *--start = '-';
        }
        return line_write(line, start, end - start);
    }
    /* beyond 64 bits: int.__repr__, which refuses more digits than the interpreter's limit */
    PyObject *text = PyLong_Type.tp_repr(number);
    if (text == NULL) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            return 0; /* the Python path writes it, with the limit lifted */
        }
        return -1;
    }
    int written = line_write(line, (const char *)PyUnicode_DATA(text), PyUnicode_GET_LENGTH(text));
    Py_DECREF(text);
    return written;
}

/* 10**0 .. 10**22, each exact as a double */
static const double powers_of_ten[] = {
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
    1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
};

/* 10**-4 .. 10**15, to place a double among them (the negative ones need not be exact) */
static const double decades[] = {1e-4, 1e-3, 1e-2, 1e-1, 1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7,
                                 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15};

/* float.__repr__ of value, written without the dtoa when it has a short decimal form: 1 when
 * written, 0 when value is left to PyOS_double_to_string.
 *
 * Taken only for 1e-4 <= |value| < 1e15 (float.__repr__ writes no exponent there) when the
 * decimal n / 10**k with 15 significant digits nearest to |value| reads back as |value|: n / 10**k
 * in double arithmetic is correctly rounded (both are exact), so that comparison is exact.
 * Distinct decimals of at most 15 significant digits read back as distinct doubles (DBL_DIG), so
 * the shortest decimal that reads back as value, which is what repr writes, is that one without
 * its trailing zeros; where the shortest has more than 15 digits the comparison fails. */
static int
write_short_float(Line *line, double value)
{
    double magnitude = fabs(value);
    if (!(magnitude >= 1e-4 && magnitude < 1e15)) {
        return 0;
    }
    int binary;
    (void)frexp(magnitude, &binary);
    int decade = (int)floor((binary - 1) * 0.30102999566398120); /* log10(magnitude), or one below */
    if (decade < -4) {
        decade = -4;
    }
    while (decade < 14 && magnitude >= decades[decade + 5]) {
        decade++;
    }
    int scale = 14 - decade; /* magnitude * 10**scale in [1e14, 1e15): 15 digits */
    long long integral = (long long)(magnitude * powers_of_ten[scale] + 0.5); /* the division decides */
    if (integral >= 1000000000000000LL || (double)integral / powers_of_ten[scale] != magnitude) {
        return 0;
    }
    while (scale > 0 && integral % 10 == 0) {
        integral /= 10;
        scale--;
    }
    char digits[24];
    char *end = digits + sizeof(digits);
    char *start = end;
    do {
        *--start = (char)('0' + integral % 10);
        integral /= 10;
    } while (integral);
    const int count = (int)(end - start);
    char text[48];
    char *out = text;
    if (value < 0) {
        *out++ = '-';
    }
    if (scale == 0) {
        memcpy(out, start, (size_t)count);
        out += count;
        *out++ = '.';
        *out++ = '0';
    }
    else if (count > scale) {
        memcpy(out, start, (size_t)(count - scale));
        out += count - scale;
        *out++ = '.';
        memcpy(out, start + count - scale, (size_t)scale);
        out += scale;
    }
    else {
        *out++ = '0';
        *out++ = '.';
        memset(out, '0', (size_t)(scale - count));
        out += scale - count;
        memcpy(out, start, (size_t)count);
        out += count;
    }
    return line_write(line, text, out - text);
}

static int
write_float(Line *line, PyObject *number)
{
    double value = PyFloat_AS_DOUBLE(number);
    if (!isfinite(value)) {
        if (value > 0) {
            return line_write(line, "Infinity", 8);
        }
        return value < 0 ? line_write(line, "-Infinity", 9) : line_write(line, "NaN", 3);
    }
    int written = write_short_float(line, value);
    if (written != 0) {
        return written;
    }
    /* float.__repr__ exactly */
    char *text = PyOS_double_to_string(value, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (text == NULL) {
        return -1;
    }
    written = line_write(line, text, (Py_ssize_t)strlen(text));
    PyMem_Free(text);
    return written;
}

static int write_value(Line *line, PyObject *value, int level);

static int
write_dict(Line *line, PyObject *node, int level)
{
    if (PyDict_GET_SIZE(node) == 0) {
        return line_write(line, "{}", 2);
    }
    if (line_write(line, "{", 1) < 0) {
        return -1;
    }
    Py_ssize_t position = 0;
    PyObject *key, *value;
    int first = 1;
    while (PyDict_Next(node, &position, &key, &value)) {
        if (Py_TYPE(key) != &PyUnicode_Type) {
            return 0;
        }
        if (!first && line_write(line, ",", 1) < 0) {
            return -1;
        }
        first = 0;
        int written = write_string(line, key);
        if (written <= 0) {
            return written;
        }
        if (line_write(line, ": ", 2) < 0) {
            return -1;
        }
        written = write_value(line, value, level);
        if (written <= 0) {
            return written;
        }
    }
    return line_write(line, "}", 1);
}

static int
write_list(Line *line, PyObject *node, int level)
{
    const Py_ssize_t size = PyList_GET_SIZE(node);
    if (line_write(line, "[", 1) < 0) {
        return -1;
    }
    for (Py_ssize_t index = 0; index < size; index++) {
        if (index && line_write(line, ",", 1) < 0) {
            return -1;
        }
        int written = write_value(line, PyList_GET_ITEM(node, index), level);
        if (written <= 0) {
            return written;
        }
    }
    return line_write(line, "]", 1);
}

/* value sits in a container at level (the record itself at 0) */
static int
write_value(Line *line, PyObject *value, int level)
{
    PyTypeObject *type = Py_TYPE(value);
    if (type == &PyFloat_Type) {
        return write_float(line, value);
    }
    if (type == &PyLong_Type) {
        return write_int(line, value);
    }
    if (type == &PyUnicode_Type) {
        return write_string(line, value);
    }
    if (value == Py_None) {
        return line_write(line, "null", 4);
    }
    if (value == Py_True) {
        return line_write(line, "true", 4);
    }
    if (value == Py_False) {
        return line_write(line, "false", 5);
    }
    if (type == &PyDict_Type || type == &PyList_Type) {
        if (level + 1 > MAX_LEVELS) {
            return 0; /* deeper (or a cycle): the Python path decides */
        }
        return type == &PyDict_Type ? write_dict(line, value, level + 1) : write_list(line, value, level + 1);
    }
    return 0;
}

static PyObject *
exact_line(PyObject *module, PyObject *value)
{
    (void)module;
    Line line = {PyBytes_FromStringAndSize(NULL, 4096), NULL, 0, 4096};
    if (line.bytes == NULL) {
        return NULL;
    }
    line.data = PyBytes_AS_STRING(line.bytes);
    int written = write_value(&line, value, 0);
    if (written > 0) {
        written = line_write(&line, "\n", 1);
    }
    if (written <= 0) {
        Py_XDECREF(line.bytes);
        if (written < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&line.bytes, line.size) < 0) {
        return NULL;
    }
    return line.bytes;
}

/* ---- encode_line: codec.encode_record's common case in one call ---- */

static PyObject *orjson_dumps = NULL; /* orjson.dumps */
static PyObject *dumps_default = NULL; /* codec._refuse */
static PyObject *dumps_option = NULL;  /* the line options */
static PyObject *dumps_kwnames = NULL; /* ("default", "option") */
static PyObject *episode_id_key = NULL;

static PyObject *
configure_encoder(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyCallable_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "configure_encoder(dumps, default, option): dumps must be callable");
        return NULL;
    }
    if (dumps_kwnames == NULL) {
        /* interned, as a call written in Python passes them: orjson matches keyword names by identity */
        PyObject *names = PyTuple_New(2);
        PyObject *name_default = PyUnicode_InternFromString("default");
        PyObject *name_option = PyUnicode_InternFromString("option");
        if (names == NULL || name_default == NULL || name_option == NULL) {
            Py_XDECREF(names);
            Py_XDECREF(name_default);
            Py_XDECREF(name_option);
            return NULL;
        }
        PyTuple_SET_ITEM(names, 0, name_default);
        PyTuple_SET_ITEM(names, 1, name_option);
        dumps_kwnames = names;
    }
    if (episode_id_key == NULL && (episode_id_key = PyUnicode_InternFromString("episode_id")) == NULL) {
        return NULL;
    }
    Py_XSETREF(orjson_dumps, Py_NewRef(args[0]));
    Py_XSETREF(dumps_default, Py_NewRef(args[1]));
    Py_XSETREF(dumps_option, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

/* Encode a record as codec.encode_record does: 1 with new references in *episode_id and *line,
 * 0 where the Python code decides (anything but an exact dict led by a non-empty exact str
 * episode_id, a record orjson refuses, or one exact_line leaves), -1 with an error set.
 * orjson's line when the fast walk passes it, else exact_line's. */
static int
encode_pair(PyObject *record, PyObject **episode_id_out, PyObject **line_out)
{
    if (Py_TYPE(record) != &PyDict_Type) {
        return 0;
    }
    Py_ssize_t position = 0;
    PyObject *key, *episode_id;
    if (!PyDict_Next(record, &position, &key, &episode_id) || Py_TYPE(key) != &PyUnicode_Type ||
        Py_TYPE(episode_id) != &PyUnicode_Type || PyUnicode_GET_LENGTH(episode_id) == 0) {
        return 0;
    }
    int named = PyUnicode_Compare(key, episode_id_key);
    if (named != 0) {
        return (named == -1 && PyErr_Occurred()) ? -1 : 0;
    }
    Py_INCREF(episode_id); /* orjson.dumps runs _refuse, Python code: keep the id alive */
    PyObject *args[] = {record, dumps_default, dumps_option};
    PyObject *line = PyObject_Vectorcall(orjson_dumps, args, 1, dumps_kwnames);
    if (line == NULL) {
        Py_DECREF(episode_id);
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
            return -1;
        }
        /* a big int, a lone surrogate, deep nesting, a cycle, not JSON: the Python code decides (and
         * a call orjson refused for any other reason can never turn a fast line into an exact one) */
        PyErr_Clear();
        return 0;
    }
    if (!fast_item(record, 0)) {
        Py_DECREF(line);
        line = exact_line(NULL, record); /* NaN, an infinity, or a type orjson converts */
        if (line == NULL || line == Py_None) {
            Py_DECREF(episode_id);
            if (line == NULL) {
                return -1;
            }
            Py_DECREF(line);
            return 0;
        }
    }
    *episode_id_out = episode_id;
    *line_out = line;
    return 1;
}

/* 1 when function (orjson_dumps, orjson_loads) was configured; else 0 with an error naming configure */
static int
configured(PyObject *function, const char *configure)
{
    if (function == NULL) {
        PyErr_Format(PyExc_RuntimeError, "gymckpt.store._exact.%s() was not called", configure);
        return 0;
    }
    return 1;
}

/* what encode_line and decode_line return for an outcome of encode_pair or decode_pair: the pair
 * (the two references are stolen), None (0) or NULL (-1, the error set) */
static PyObject *
pair_or_none(int outcome, PyObject *first, PyObject *second)
{
    if (outcome <= 0) {
        return outcome == 0 ? Py_NewRef(Py_None) : NULL;
    }
    PyObject *pair = PyTuple_Pack(2, first, second);
    Py_DECREF(first);
    Py_DECREF(second);
    return pair;
}

/* (episode_id, line) of a record, as codec.encode_record returns them, or None where the Python
 * code decides (see encode_pair). */
static PyObject *
encode_line(PyObject *module, PyObject *record)
{
    (void)module;
    if (!configured(orjson_dumps, "configure_encoder")) {
        return NULL;
    }
    PyObject *episode_id = NULL, *line = NULL;
    int encoded = encode_pair(record, &episode_id, &line); /* before the call reads the two */
    return pair_or_none(encoded, episode_id, line);
}

/* ---- pre-encoded records (encoded.EncodedRecord): taken as they are where their look passes ---- */

static PyObject *encoded_type = NULL; /* encoded.EncodedRecord, from configure_encoded */
static PyObject *run_type = NULL;     /* encoded.EncodedRun, from configure_encoded */

static PyObject *
configure_encoded(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "configure_encoded(record_type[, run_type]): one or two tuple types");
        return NULL;
    }
    for (Py_ssize_t index = 0; index < nargs; index++) {
        if (!PyType_Check(args[index]) || !PyType_IsSubtype((PyTypeObject *)args[index], &PyTuple_Type)) {
            PyErr_SetString(PyExc_TypeError,
                            "configure_encoded(record_type[, run_type]): tuple types (encoded.EncodedRecord, "
                            "encoded.EncodedRun)");
            return NULL;
        }
    }
    Py_XSETREF(encoded_type, Py_NewRef(args[0]));
    Py_XSETREF(run_type, nargs == 2 ? Py_NewRef(args[1]) : NULL);
    Py_RETURN_NONE;
}

static const char fast_prefix[] = "{\"episode_id\":\""; /* codec.FAST_PREFIX */
#define FAST_PREFIX_LENGTH 15

/* 1 when the line starts with the fast prefix */
static inline int
has_fast_prefix(const char *bytes, Py_ssize_t length)
{
    return length > FAST_PREFIX_LENGTH && memcmp(bytes, fast_prefix, FAST_PREFIX_LENGTH) == 0;
}

/* 1 when the line's leading token is exactly '"' + the id's UTF-8 + '"' (how orjson writes an id
 * without a quote, a backslash or a control character); 0 otherwise, never an error */
static int
leads_with(const char *bytes, Py_ssize_t length, PyObject *episode_id)
{
    Py_ssize_t size;
    const char *text = PyUnicode_AsUTF8AndSize(episode_id, &size);
    if (text == NULL) {
        PyErr_Clear();
        return 0;
    }
    for (Py_ssize_t index = 0; index < size; index++) {
        unsigned char c = (unsigned char)text[index];
        if (c < 0x20 || c == '"' || c == '\\') {
            return 0;
        }
    }
    return length > FAST_PREFIX_LENGTH + size && has_fast_prefix(bytes, length) &&
           memcmp(bytes + FAST_PREFIX_LENGTH, text, (size_t)size) == 0 && bytes[FAST_PREFIX_LENGTH + size] == '"';
}

/* A pre-encoded record as encoded.check_encoded accepts it: 1 with new references in *episode_id and
 * *line, 0 where the Python code decides (and raises, if it must): anything but a (str, bytes)
 * pair whose line is one line ending with its newline, led by orjson's token of that id (leads_with). */
static int
take_encoded(PyObject *record, PyObject **episode_id_out, PyObject **line_out)
{
    if (PyTuple_GET_SIZE(record) != 2) {
        return 0;
    }
    PyObject *episode_id = PyTuple_GET_ITEM(record, 0), *line = PyTuple_GET_ITEM(record, 1);
    if (!PyUnicode_CheckExact(episode_id) || !PyBytes_CheckExact(line)) {
        return 0;
    }
    const char *data = PyBytes_AS_STRING(line);
    Py_ssize_t length = PyBytes_GET_SIZE(line);
    if (length == 0 || data[length - 1] != '\n' || memchr(data, '\n', (size_t)(length - 1)) != NULL ||
        !leads_with(data, length, episode_id)) {
        return 0;
    }
    *episode_id_out = Py_NewRef(episode_id);
    *line_out = Py_NewRef(line);
    return 1;
}

/* A run of pre-encoded lines (encoded.EncodedRun: a list of ids, the bytes of their lines) as
 * encoded.check_run accepts it, none of its ids in seen nor twice in it: 1 once its ids are in seen
 * and ids, its lines appended to batch at *filled (grown as needed; batch NULL: nothing copied,
 * *filled still advanced) and *longest updated; 0 with nothing changed where the Python code
 * decides (and raises); -1 on an error. */
static int
take_run(PyObject *record, PyObject *batch, Py_ssize_t *filled, PyObject *seen, PyObject *ids, Py_ssize_t *longest)
{
    if (PyTuple_GET_SIZE(record) != 2) {
        return 0;
    }
    PyObject *names = PyTuple_GET_ITEM(record, 0), *lines = PyTuple_GET_ITEM(record, 1);
    if (!PyList_CheckExact(names) || !PyBytes_CheckExact(lines)) {
        return 0;
    }
    const char *data = PyBytes_AS_STRING(lines);
    Py_ssize_t size = PyBytes_GET_SIZE(lines), count = PyList_GET_SIZE(names), start = 0, run_longest = 0;
    for (Py_ssize_t index = 0; index < count; index++) {
        PyObject *episode_id = PyList_GET_ITEM(names, index);
        if (!PyUnicode_CheckExact(episode_id) || start >= size) {
            return 0;
        }
        const char *newline = memchr(data + start, '\n', (size_t)(size - start));
        if (newline == NULL) {
            return 0;
        }
        Py_ssize_t length = newline - (data + start) + 1;
        if (!leads_with(data + start, length, episode_id)) {
            return 0;
        }
        int known = PySet_Contains(seen, episode_id);
        if (known != 0) {
            return known < 0 ? -1 : 0;
        }
        if (length > run_longest) {
            run_longest = length;
        }
        start += length;
    }
    if (start != size) {
        return 0;
    }
    Py_ssize_t before = PySet_GET_SIZE(seen);
    for (Py_ssize_t index = 0; index < count; index++) {
        if (PySet_Add(seen, PyList_GET_ITEM(names, index)) < 0) {
            return -1;
        }
    }
    if (PySet_GET_SIZE(seen) != before + count) { /* an id twice in the run: undone, the Python code names it */
        for (Py_ssize_t index = 0; index < count; index++) {
            if (PySet_Discard(seen, PyList_GET_ITEM(names, index)) < 0) {
                return -1;
            }
        }
        return 0;
    }
    Py_ssize_t end = *filled + size;
    if (batch != NULL && end > PyByteArray_GET_SIZE(batch) && PyByteArray_Resize(batch, end) < 0) {
        return -1;
    }
    for (Py_ssize_t index = 0; index < count; index++) {
        if (PyList_Append(ids, PyList_GET_ITEM(names, index)) < 0) {
            return -1;
        }
    }
    if (batch != NULL) {
        memcpy(PyByteArray_AS_STRING(batch) + *filled, data, (size_t)size);
    }
    *filled = end;
    if (run_longest > *longest) {
        *longest = run_longest;
    }
    return 1;
}

/* the lines append_lines writes between two moments it lets other threads take the interpreter
 * (the records writer hashing and writing the chunks handed over before): C code that never
 * returns to the interpreter otherwise keeps it for a whole chunk */
#define YIELD_BYTES (256 << 10)

/* append_lines(records, batch, filled, target, seen, ids[, longest]) -> (filled, ended, record[, longest])
 *
 * write_records' loop for the records encode_line writes: takes records from the iterator,
 * appends each line to the bytearray batch at offset filled (growing it only when the line does
 * not fit), its id to the set seen and the list ids, until filled reaches target or the iterator
 * ends (ended: True). Otherwise, with filled still below target, record is one it left to the
 * Python code (encode_line's None, or an id already in seen; any object, None too) with nothing
 * of it appended. A line is let go as soon as it is copied. Given longest (an int), the answer
 * ends with the larger of it and the longest line appended (a manifest's max_record_bytes). */
static PyObject *
append_lines(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if ((nargs != 6 && nargs != 7) || !PyIter_Check(args[0]) || !PyByteArray_CheckExact(args[1]) ||
        !PyLong_CheckExact(args[2]) || !PyLong_CheckExact(args[3]) || !PyAnySet_CheckExact(args[4]) ||
        !PyList_CheckExact(args[5]) || (nargs == 7 && !PyLong_CheckExact(args[6]))) {
        PyErr_SetString(PyExc_TypeError, "append_lines(records: iterator, batch: bytearray, filled: int, target: int, "
                                         "seen: set, ids: list[, longest: int])");
        return NULL;
    }
    if (!configured(orjson_dumps, "configure_encoder")) {
        return NULL;
    }
    PyObject *records = args[0], *batch = args[1], *seen = args[4], *ids = args[5];
    Py_ssize_t filled = PyLong_AsSsize_t(args[2]);
    Py_ssize_t target = PyLong_AsSsize_t(args[3]);
    Py_ssize_t longest = nargs == 7 ? PyLong_AsSsize_t(args[6]) : 0;
    if ((filled == -1 || target == -1 || longest == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (filled < 0 || filled > PyByteArray_GET_SIZE(batch)) {
        PyErr_SetString(PyExc_ValueError, "append_lines: filled is outside the batch");
        return NULL;
    }
    PyObject *left = NULL;
    int ended = 0;
    Py_ssize_t since_yield = 0;
    while (filled < target) {
        PyObject *record = PyIter_Next(records);
        if (record == NULL) {
            if (PyErr_Occurred()) {
                return NULL;
            }
            ended = 1;
            break;
        }
        if (run_type != NULL && (PyObject *)Py_TYPE(record) == run_type) {
            Py_ssize_t was = filled;
            int taken = take_run(record, batch, &filled, seen, ids, &longest);
            if (taken <= 0) {
                if (taken < 0) {
                    Py_DECREF(record);
                    return NULL;
                }
                left = record;
                break;
            }
            Py_DECREF(record);
            since_yield += filled - was;
            if (since_yield >= YIELD_BYTES) {
                since_yield = 0;
                Py_BEGIN_ALLOW_THREADS
                Py_END_ALLOW_THREADS
            }
            continue;
        }
        PyObject *episode_id, *line;
        int encoded = encoded_type != NULL && (PyObject *)Py_TYPE(record) == encoded_type
                          ? take_encoded(record, &episode_id, &line)
                          : encode_pair(record, &episode_id, &line);
        if (encoded < 0) {
            Py_DECREF(record);
            return NULL;
        }
        if (encoded == 0) {
            left = record;
            break;
        }
        int known = PySet_Contains(seen, episode_id);
        if (known != 0) {
            Py_DECREF(episode_id);
            Py_DECREF(line);
            if (known < 0) {
                Py_DECREF(record);
                return NULL;
            }
            left = record; /* the Python code names the duplicate */
            break;
        }
        Py_DECREF(record);
        Py_ssize_t length = PyBytes_GET_SIZE(line);
        Py_ssize_t end = filled + length;
        if (PySet_Add(seen, episode_id) < 0 || PyList_Append(ids, episode_id) < 0 ||
            (end > PyByteArray_GET_SIZE(batch) && PyByteArray_Resize(batch, end) < 0)) {
            Py_DECREF(episode_id);
            Py_DECREF(line);
            return NULL;
        }
        Py_DECREF(episode_id);
        memcpy(PyByteArray_AS_STRING(batch) + filled, PyBytes_AS_STRING(line), (size_t)length);
        Py_DECREF(line);
        filled = end;
        if (length > longest) {
            longest = length;
        }
        since_yield += length;
        if (since_yield >= YIELD_BYTES) {
            since_yield = 0;
            Py_BEGIN_ALLOW_THREADS
            Py_END_ALLOW_THREADS
        }
    }
    PyObject *outcome = ended ? Py_True : Py_False, *record = left == NULL ? Py_None : left;
    PyObject *answer = nargs == 7 ? Py_BuildValue("(nOOn)", filled, outcome, record, longest)
                                  : Py_BuildValue("(nOO)", filled, outcome, record);
    Py_XDECREF(left);
    return answer;
}

/* note_run(run, seen, ids, longest) -> longest | None
 *
 * The look append_lines gives a run (encoded.EncodedRun), for lines already in the file: its ids go
 * to seen and ids and the answer is the larger of longest and its longest line, nothing copied;
 * None, with nothing changed, where the Python code decides (encoded.check_run). */
static PyObject *
note_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4 || run_type == NULL || (PyObject *)Py_TYPE(args[0]) != run_type || !PyAnySet_CheckExact(args[1]) ||
        !PyList_CheckExact(args[2]) || !PyLong_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "note_run(run: EncodedRun (configured), seen: set, ids: list, longest: int)");
        return NULL;
    }
    Py_ssize_t longest = PyLong_AsSsize_t(args[3]), filled = 0;
    if (longest == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int taken = take_run(args[0], NULL, &filled, args[1], args[2], &longest);
    if (taken < 0) {
        return NULL;
    }
    if (taken == 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromSsize_t(longest);
}

/* ---- decode_line: codec.decode_line_and_id's common case in one call ---- */

static PyObject *orjson_loads = NULL; /* orjson.loads */

static PyObject *
configure_decoder(PyObject *module, PyObject *loads)
{
    (void)module;
    if (!PyCallable_Check(loads)) {
        PyErr_SetString(PyExc_TypeError, "configure_decoder(loads): loads must be callable");
        return NULL;
    }
    if (episode_id_key == NULL && (episode_id_key = PyUnicode_InternFromString("episode_id")) == NULL) {
        return NULL;
    }
    Py_XSETREF(orjson_loads, Py_NewRef(loads));
    Py_RETURN_NONE;
}

/* ---- no key twice in one object ----
 *
 * orjson keeps the last of two equal keys (and the stdlib decoder too), so a line holding a key
 * twice decodes to a record that differs from what a first-wins reader sees. Such a line is
 * damage. The check costs no second parse: the keys of a JSON text are its colons outside
 * strings, its objects its '{' outside strings; a decoded record holds as many keys, summed over
 * its dicts, exactly when no object repeated a key (a repeated key drops at least itself). The
 * walk over the decoded record stops once it has met as many dicts as the text has objects, and
 * is skipped for a flat record. On the benchmark's workloads the check adds about a tenth to
 * decode_lines' time for records of a few KB (W2) and less for large ones (W1), the scan most of it. */

#if defined(__SSE2__) && !defined(GYMCKPT_NO_SSE2) /* GYMCKPT_NO_SSE2: build the portable scan (tests) */
#include <emmintrin.h>

/* 64 bytes at a time, without a branch on the data (how simdjson finds a document's structure): a
 * bitmask per byte class, the quotes an odd run of backslashes escapes removed, the bytes inside
 * strings from a prefix XOR of the quotes left; x86-64 always has SSE2 */

/* bit i set where byte i of the 64 bytes compared is set (a compare's result per 16 bytes) */
static inline unsigned long long
block_bits(const __m128i found[4])
{
    unsigned long long mask = 0;
    for (int part = 0; part < 4; part++) {
        mask |= (unsigned long long)(unsigned int)_mm_movemask_epi8(found[part]) << (16 * part);
    }
    return mask;
}

static inline int
bit_count(unsigned long long bits)
{
    bits = bits - ((bits >> 1) & 0x5555555555555555ULL);
    bits = (bits & 0x3333333333333333ULL) + ((bits >> 2) & 0x3333333333333333ULL);
    bits = (bits + (bits >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
    return (int)((bits * 0x0101010101010101ULL) >> 56);
}

/* bit i set where the byte at i ends an odd run of backslashes before it (an escaped byte);
 * *carry: 1 when the block before ended inside an odd run */
static inline unsigned long long
escaped_bytes(unsigned long long backslashes, unsigned long long *carry)
{
    const unsigned long long even_bits = 0x5555555555555555ULL;
    const unsigned long long odd_bits = ~even_bits;
    unsigned long long starts = backslashes & ~(backslashes << 1);
    unsigned long long even_start_mask = even_bits ^ *carry;
    unsigned long long even_starts = starts & even_start_mask;
    unsigned long long odd_starts = starts & ~even_start_mask;
    unsigned long long even_carries = backslashes + even_starts;
    unsigned long long odd_carries = backslashes + odd_starts;
    unsigned long long ends_odd = odd_carries < backslashes; /* the addition overflowed: the run goes on */
    odd_carries |= *carry;
    *carry = ends_odd;
    unsigned long long even_start_odd_end = even_carries & ~backslashes & odd_bits;
    unsigned long long odd_start_even_end = odd_carries & ~backslashes & even_bits;
    return even_start_odd_end | odd_start_even_end;
}

/* bit i set where an odd number of bits at or below i are set */
static inline unsigned long long
prefix_xor(unsigned long long bits)
{
    bits ^= bits << 1;
    bits ^= bits << 2;
    bits ^= bits << 4;
    bits ^= bits << 8;
    bits ^= bits << 16;
    bits ^= bits << 32;
    return bits;
}

/* the keys (colons outside strings) and objects ('{' outside strings) of a JSON text orjson accepted */
static void
count_keys_and_objects(const char *text, Py_ssize_t length, Py_ssize_t *keys_out, Py_ssize_t *objects_out)
{
    Py_ssize_t keys = 0, objects = 0;
    unsigned long long odd_backslash_carry = 0, in_string_carry = 0;
    unsigned char tail[64];
    for (Py_ssize_t offset = 0; offset < length; offset += 64) {
        const unsigned char *block = (const unsigned char *)text + offset;
        if (length - offset < 64) { /* the last bytes, padded with spaces (no byte class counted) */
            memset(tail, ' ', sizeof(tail));
            memcpy(tail, block, (size_t)(length - offset));
            block = tail;
        }
        __m128i quote[4], backslash[4], colon[4], brace[4], any[4];
        for (int part = 0; part < 4; part++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 16 * part));
            quote[part] = _mm_cmpeq_epi8(bytes, _mm_set1_epi8('"'));
            backslash[part] = _mm_cmpeq_epi8(bytes, _mm_set1_epi8('\\'));
            colon[part] = _mm_cmpeq_epi8(bytes, _mm_set1_epi8(':'));
            brace[part] = _mm_cmpeq_epi8(bytes, _mm_set1_epi8('{'));
            any[part] = _mm_or_si128(_mm_or_si128(quote[part], backslash[part]), _mm_or_si128(colon[part], brace[part]));
        }
        if (block_bits(any) == 0 && odd_backslash_carry == 0) {
            continue; /* digits or a string's plain text (most blocks): inside or outside a string as before */
        }
        unsigned long long backslashes = block_bits(backslash);
        unsigned long long quotes = block_bits(quote);
        if (backslashes != 0 || odd_backslash_carry != 0) {
            quotes &= ~escaped_bytes(backslashes, &odd_backslash_carry);
        }
        unsigned long long in_string = prefix_xor(quotes) ^ in_string_carry;
        in_string_carry = (unsigned long long)((long long)in_string >> 63);
        keys += bit_count(block_bits(colon) & ~in_string);
        objects += bit_count(block_bits(brace) & ~in_string);
    }
    *keys_out = keys;
    *objects_out = objects;
}

#else

/* Without SSE2: 8 bytes at a time where the compiler allows (SWAR: a byte test on a whole word),
 * strings skipped to their next quote or backslash; about twice the SSE2 scan's cost. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define SWAR 1
#define SWAR_ONES 0x0101010101010101ULL
#define SWAR_LOWS 0x7f7f7f7f7f7f7f7fULL

/* the high bit of each byte of the result is set exactly where that byte of word is the byte whose
 * 8 copies are repeated (no carry crosses a byte, so there are no false matches) */
static inline unsigned long long
bytes_equal(unsigned long long word, unsigned long long repeated)
{
    unsigned long long x = word ^ repeated;
    return ~(((x & SWAR_LOWS) + SWAR_LOWS) | x | SWAR_LOWS);
}

/* how many bytes a bytes_equal result marks */
static inline Py_ssize_t
marked(unsigned long long found)
{
    return (Py_ssize_t)(((found >> 7) * SWAR_ONES) >> 56);
}

static inline unsigned long long
load_word(const unsigned char *at)
{
    unsigned long long word;
    memcpy(&word, at, sizeof(word));
    return word;
}
#else
#define SWAR 0
#endif

/* outside a string: counts ':' (keys) and '{' (objects) up to the next '"'; returns where it is, or end */
static inline const unsigned char *
count_to_quote(const unsigned char *at, const unsigned char *end, Py_ssize_t *keys, Py_ssize_t *objects)
{
#if SWAR
    while (end - at >= 8) {
        unsigned long long word = load_word(at);
        unsigned long long quotes = bytes_equal(word, SWAR_ONES * '"');
        unsigned long long colons = bytes_equal(word, SWAR_ONES * ':');
        unsigned long long braces = bytes_equal(word, SWAR_ONES * '{');
        if (quotes != 0) {
            unsigned long long before = (quotes & (0 - quotes)) - 1; /* the bytes before the first quote */
            *keys += marked(colons & before);
            *objects += marked(braces & before);
            return at + (__builtin_ctzll(quotes) >> 3);
        }
        *keys += marked(colons);
        *objects += marked(braces);
        at += 8;
    }
#endif
    for (; at < end && *at != '"'; at++) {
        *keys += *at == ':';
        *objects += *at == '{';
    }
    return at;
}

/* inside a string (at: after its opening quote): returns where its closing quote is, or end; an escape
 * skips the byte after its backslash */
static inline const unsigned char *
skip_string(const unsigned char *at, const unsigned char *end)
{
    for (;;) {
#if SWAR
        while (end - at >= 8) {
            unsigned long long word = load_word(at);
            unsigned long long stops = bytes_equal(word, SWAR_ONES * '"') | bytes_equal(word, SWAR_ONES * '\\');
            if (stops != 0) {
                at += __builtin_ctzll(stops) >> 3;
                break;
            }
            at += 8;
        }
#endif
        while (at < end && *at != '"' && *at != '\\') {
            at++;
        }
        if (at >= end || *at == '"') {
            return at < end ? at : end;
        }
        at += 2; /* a backslash and the byte it escapes */
    }
}

/* the keys (colons outside strings) and objects ('{' outside strings) of a JSON text orjson accepted */
static void
count_keys_and_objects(const char *text, Py_ssize_t length, Py_ssize_t *keys_out, Py_ssize_t *objects_out)
{
    const unsigned char *at = (const unsigned char *)text;
    const unsigned char *end = at + length;
    Py_ssize_t keys = 0, objects = 0;
    while ((at = count_to_quote(at, end, &keys, &objects)) < end) {
        at = skip_string(at + 1, end);
        if (at < end) {
            at++; /* past the closing quote */
        }
    }
    *keys_out = keys;
    *objects_out = objects;
}

#endif

static inline int
is_container(PyObject *value)
{
    return Py_TYPE(value) == &PyDict_Type || Py_TYPE(value) == &PyList_Type;
}

/* adds the sizes of the dicts in node (itself included) to *keys and their number to *dicts, in
 * document order, until *dicts reaches objects; recursion is bounded by orjson's depth limit.
 *
 * A list that neither begins nor ends with a container is taken for one of scalars and skipped:
 * a record's long lists are token ids and logprobs, and visiting their items would cost most of
 * the check. Skipping can only leave keys uncounted, never count one twice, so a list holding
 * dicts between scalars makes its line look like one with a key twice: the Python code decides
 * it (exactly, and slower), never a false acceptance. */
static void
sum_dict_sizes(PyObject *node, Py_ssize_t objects, Py_ssize_t *keys, Py_ssize_t *dicts)
{
    if (Py_TYPE(node) == &PyDict_Type) {
        *keys += PyDict_GET_SIZE(node);
        (*dicts)++;
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (*dicts < objects && PyDict_Next(node, &position, &key, &value)) {
            if (is_container(value)) {
                sum_dict_sizes(value, objects, keys, dicts);
            }
        }
        return;
    }
    const Py_ssize_t size = PyList_GET_SIZE(node);
    if (size > 2 && !is_container(PyList_GET_ITEM(node, 0)) && !is_container(PyList_GET_ITEM(node, size - 1))) {
        return;
    }
    for (Py_ssize_t index = 0; index < size && *dicts < objects; index++) {
        PyObject *item = PyList_GET_ITEM(node, index);
        if (is_container(item)) {
            sum_dict_sizes(item, objects, keys, dicts);
        }
    }
}

/* 1 when no object of the line (bytes orjson decoded to the dict record) holds a key twice, else 0 */
static int
keys_unique(PyObject *record, const char *bytes, Py_ssize_t length)
{
    Py_ssize_t keys, objects;
    count_keys_and_objects(bytes, length, &keys, &objects);
    if (objects == 1) {
        return PyDict_GET_SIZE(record) == keys;
    }
    Py_ssize_t decoded = 0, dicts = 0;
    sum_dict_sizes(record, objects, &decoded, &dicts);
    return decoded == keys;
}

/* Decode a fast line as codec.decode_line_and_id does: 1 with new references in *episode_id and
 * *record, 0 where the Python code decides (an exact or damaged line, a key twice in one object,
 * or an id orjson spells with escapes), -1 with an error set. line is the object orjson reads;
 * bytes and length are its buffer, valid for the call. */
static int
decode_pair(PyObject *line, const char *bytes, Py_ssize_t length, PyObject **episode_id_out, PyObject **record_out)
{
    if (!has_fast_prefix(bytes, length)) {
        return 0;
    }
    PyObject *record = PyObject_CallOneArg(orjson_loads, line);
    if (record == NULL) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear(); /* damage: the Python code names it */
            return 0;
        }
        return -1;
    }
    Py_ssize_t position = 0;
    PyObject *key, *episode_id;
    if (Py_TYPE(record) == &PyDict_Type && PyDict_Next(record, &position, &key, &episode_id) &&
        Py_TYPE(key) == &PyUnicode_Type && Py_TYPE(episode_id) == &PyUnicode_Type &&
        PyUnicode_Compare(key, episode_id_key) == 0 && leads_with(bytes, length, episode_id) &&
        keys_unique(record, bytes, length)) {
        *episode_id_out = Py_NewRef(episode_id);
        *record_out = record;
        return 1;
    }
    PyErr_Clear(); /* PyUnicode_Compare cannot fail on two str; nothing else here sets an error */
    Py_DECREF(record);
    return 0;
}

/* (episode_id, record) of a fast line (bytes or memoryview), as codec.decode_line_and_id returns
 * them, or None where the Python code decides (see decode_pair). */
static PyObject *
decode_line(PyObject *module, PyObject *line)
{
    (void)module;
    if (!configured(orjson_loads, "configure_decoder")) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(line, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *episode_id = NULL, *record = NULL;
    int decoded = decode_pair(line, (const char *)view.buf, view.len, &episode_id, &record);
    PyBuffer_Release(&view);
    return pair_or_none(decoded, episode_id, record);
}

/* decode_lines(chunk, start, limit, ids[, line_limit]) -> (records, position)
 *
 * read_records' loop over fast lines: decodes the newline-ended lines of the bytes chunk from
 * offset start, as decode_line does, appending each id to the list ids and each record to the
 * list it returns, until the lines read pass limit bytes, a line is no fast line or takes more
 * than line_limit bytes with its newline (either left to the Python code), or no newline is
 * left. position is where the next line starts: the line it left, the rest of a line the next
 * chunk ends, or len(chunk). */
static PyObject *
decode_lines(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if ((nargs != 4 && nargs != 5) || !PyBytes_CheckExact(args[0]) || !PyLong_CheckExact(args[1]) ||
        !PyLong_CheckExact(args[2]) || !PyList_CheckExact(args[3]) || (nargs == 5 && !PyLong_CheckExact(args[4]))) {
        PyErr_SetString(PyExc_TypeError,
                        "decode_lines(chunk: bytes, start: int, limit: int, ids: list[, line_limit: int])");
        return NULL;
    }
    if (!configured(orjson_loads, "configure_decoder")) {
        return NULL;
    }
    PyObject *chunk = args[0], *ids = args[3];
    const char *data = PyBytes_AS_STRING(chunk);
    Py_ssize_t size = PyBytes_GET_SIZE(chunk);
    Py_ssize_t position = PyLong_AsSsize_t(args[1]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    Py_ssize_t line_limit = nargs == 5 ? PyLong_AsSsize_t(args[4]) : PY_SSIZE_T_MAX;
    if ((position == -1 || limit == -1 || line_limit == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (position < 0 || position > size || limit < 0 || line_limit < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "decode_lines: start is outside the chunk, or limit or line_limit is negative");
        return NULL;
    }
    PyObject *records = PyList_New(0);
    if (records == NULL) {
        return NULL;
    }
    Py_ssize_t stop = limit < size - position ? position + limit : size;
    while (position < stop) {
        const char *line = data + position;
        const char *newline = memchr(line, '\n', (size_t)(size - position));
        if (newline == NULL) {
            break;
        }
        Py_ssize_t length = newline - line;
        if (length >= line_limit || !has_fast_prefix(line, length)) {
            break; /* a line longer than the manifest allows (with its newline) is damage the Python code names */
        }
        /* a view of the chunk, which outlives it: orjson copies what it keeps */
        PyObject *view = PyMemoryView_FromMemory((char *)line, length, PyBUF_READ);
        if (view == NULL) {
            Py_DECREF(records);
            return NULL;
        }
        PyObject *episode_id, *record;
        int decoded = decode_pair(view, line, length, &episode_id, &record);
        Py_DECREF(view);
        if (decoded < 0) {
            Py_DECREF(records);
            return NULL;
        }
        if (decoded == 0) {
            break;
        }
        int failed = PyList_Append(ids, episode_id) < 0 || PyList_Append(records, record) < 0;
        Py_DECREF(episode_id);
        Py_DECREF(record);
        if (failed) {
            Py_DECREF(records);
            return NULL;
        }
        position += length + 1;
    }
    PyObject *answer = Py_BuildValue("(Nn)", records, position);
    return answer;
}

static PyMethodDef methods[] = {
    {"fast_path_safe", fast_path_safe, METH_O,
     "fast_path_safe(value) -> bool: True when orjson writes value exactly (exact JSON types, finite floats, "
     "64-bit ints, at most 254 levels)."},
    {"exact_line", exact_line, METH_O,
     "exact_line(value) -> bytes | None: json.dumps(value, ensure_ascii=True, allow_nan=True, "
     "separators=(',', ': ')) and a newline, byte for byte; None for what it leaves to the Python path."},
    {"configure_encoder", (PyCFunction)(void (*)(void))configure_encoder, METH_FASTCALL,
     "configure_encoder(dumps, default, option) -> None: how encode_line calls orjson."},
    {"configure_encoded", (PyCFunction)(void (*)(void))configure_encoded, METH_FASTCALL,
     "configure_encoded(record_type[, run_type]) -> None: the types of pre-encoded records and runs of them "
     "(encoded.EncodedRecord, encoded.EncodedRun) append_lines takes as they are."},
    {"encode_line", encode_line, METH_O,
     "encode_line(record) -> (episode_id, line) | None: codec.encode_record's answer for a record it writes "
     "without Python code; None where the Python code decides."},
    {"note_run", (PyCFunction)(void (*)(void))note_run, METH_FASTCALL,
     "note_run(run, seen, ids, longest) -> longest | None: append_lines' look at a run of lines already written, "
     "nothing copied; None where the Python code decides."},
    {"append_lines", (PyCFunction)(void (*)(void))append_lines, METH_FASTCALL,
     "append_lines(records, batch, filled, target, seen, ids[, longest]) -> (filled, ended, record[, longest]): "
     "write_records' loop for the records encode_line writes; returns at target, at the end, or with a record left "
     "to Python."},
    {"configure_decoder", configure_decoder, METH_O, "configure_decoder(loads) -> None: the orjson.loads decode_line calls."},
    {"decode_lines", (PyCFunction)(void (*)(void))decode_lines, METH_FASTCALL,
     "decode_lines(chunk, start, limit, ids[, line_limit]) -> (records, position): read_records' loop over fast "
     "lines, from start until limit bytes, a line left to Python (or longer than line_limit), or the last newline."},
    {"decode_line", decode_line, METH_O,
     "decode_line(line) -> (episode_id, record) | None: codec.decode_line_and_id's answer for a fast line; "
     "None where the Python code decides."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "gymckpt.store._exact", "The records codec's exactness walk and exact encoder, in C.", -1, methods,
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
