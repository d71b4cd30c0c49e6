"""One ONNX Runtime thread in every session the peer opens (PYTHONPATH=lab/infinity_peer when starting Infinity):
its default session adds an intra-op thread per core it sees, even when pinned to one."""

import onnxruntime as ort

_init = ort.InferenceSession.__init__


def _one_thread(self, path_or_bytes, sess_options=None, *args, **kwargs):  # type: ignore[no-untyped-def]
    opts = sess_options or ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    _init(self, path_or_bytes, opts, *args, **kwargs)


ort.InferenceSession.__init__ = _one_thread
