/* tierkv._native: the module (native.h says what each part does). */
#include "native.h"

static PyMethodDef methods[] = {
    {"read_run", read_run, METH_VARARGS, read_run_doc},
    {"write_run", write_run, METH_VARARGS, write_run_doc},
    {"copy_blocks", copy_blocks, METH_VARARGS, copy_blocks_doc},
    {"copy_paged", copy_paged, METH_VARARGS, copy_paged_doc},
    {"set_work_cpus", set_work_cpus, METH_O, "set_work_cpus(cpus): the CPUs every helper thread runs on."},
    {"xxh3_64", py_xxh3, METH_O, "xxh3-64 of a buffer, as libxxhash computes it (tests compare it with xxhash's)."},
    {"inject_fault", inject_fault, METH_VARARGS,
     "inject_fault(dev, ino, start, end, errno, kind=0): reads of that range fail (kind 1: writes; + 2:\n"
     "only through O_DIRECT descriptors)."},
    {"clear_faults", clear_faults, METH_NOARGS, "Remove every injected fault."},
    {"cached_nbytes", cached_nbytes, METH_VARARGS, cached_nbytes_doc},
    {"hashed_on_arrival", hashed_on_arrival, METH_NOARGS,
     "Records read_run has hashed as their bytes arrived, in this process (tests)."},
    {"streamed_reads", streamed_reads, METH_NOARGS,
     "streamed_reads() -> (groups, files): the groups read_run has read from the disk through a reading\n"
     "thread's own file, and the files it opened for that, in this process (tests)."},
    {"fail_images", fail_images, METH_VARARGS,
     "fail_images(skip, count): write_run's next ``skip`` image allocations succeed, the ``count`` after\n"
     "them find no memory (tests; (0, 0) ends it)."},
    {"can_leave_idle", can_leave_idle, METH_NOARGS, "Whether a thread may go to SCHED_IDLE and come back (probed)."},
    {"trace_writes", trace_writes, METH_O, "trace_writes(on) -> the writes and syncs logged since the last call."},
    {"why_unavailable", why_unavailable, METH_NOARGS, "None if usable, else why not."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    load_xxhash();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyModule_AddIntConstant(m, "ABI", ABI);
    PyModule_AddIntConstant(m, "ALIGN", ALIGN);
    PyModule_AddIntConstant(m, "HEADER_NBYTES", HEADER_NBYTES);
    PyModule_AddIntConstant(m, "GROUP_NBYTES", GROUP_NBYTES);
    PyModule_AddIntConstant(m, "XXH3_DISPATCHED", xxh3_dispatched);
    PyModule_AddIntConstant(m, "ST_OK", ST_OK);
    PyModule_AddIntConstant(m, "ST_BAD", ST_BAD);
    PyModule_AddIntConstant(m, "ST_MEDIA", ST_MEDIA);
    PyModule_AddIntConstant(m, "ST_PYTHON", ST_PYTHON);
    PyModule_AddIntConstant(m, "ST_TRANSIENT", ST_TRANSIENT);
    PyObject *all = Py_BuildValue("[sssssssssssssss]", "read_run", "cached_nbytes", "write_run", "copy_blocks", "copy_paged", "set_work_cpus", "xxh3_64", "inject_fault",
                                  "clear_faults", "fail_images", "hashed_on_arrival", "streamed_reads", "trace_writes", "can_leave_idle",
                                  "why_unavailable");
    if (!all || PyModule_AddObject(m, "__all__", all) != 0) {
        Py_XDECREF(all);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
