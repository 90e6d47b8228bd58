"""Where raychat meets Ray itself, apart from Train's and Data's public API.

    cluster_address  which Ray a command joins: RAY_ADDRESS checked first, else a local instance
    quiet            Ray's chatter silenced in every process of the run
    runtime_env      the environment workers get, without credentials
    nccl_transport   which link NCCL chose between nodes, said once at start
    ray_internals    every private Ray API raychat uses, each with why
"""
