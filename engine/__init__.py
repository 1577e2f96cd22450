"""The engine core: scheduler, admission, request state, batches, output processor, the executor
interface and the in-process executor. It imports without Ray; the Ray parts are in cluster/."""
