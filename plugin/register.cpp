// Library-level registration that is not an op: nothing yet besides the
// version op in ops/version.cpp; the ddpx_mpi backend registers itself with
// torch.distributed from the Python glue (plugin/python).
