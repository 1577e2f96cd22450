"""A Serve request router whose chosen replica goes to the request it was chosen for.

Serve runs one routing task per waiting request: it calls ``choose_replicas`` with that request,
then hands the replica it picked to a waiting request through ``_fulfill_next_pending_request``.
Which request gets it is the router's matching, and neither of Serve's two fits a router that
chooses by the prompt:

- ``FIFOMixin`` gives it to the *oldest* waiting request. With several requests routed at once,
  a replica chosen for one prompt's prefix went to another prompt, which it held nothing of.
- The default matches on ``metadata.internal_request_id``. Every handle call made while serving
  one HTTP request inherits that request's id (the ingress sends one engine request per choice,
  so ``n=2`` makes two), and Serve indexes only the first call under it: the second call's
  replica went to the first call, or to nobody once the first was routed, and the second call
  waited for ever.

Here each waiting request is indexed by its own ``RequestMetadata`` object, which each handle
call makes anew and which the routing task passes back with the replica it chose.
"""

from __future__ import annotations

from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class OwnRequestRouter(RequestRouter):
    """Routes each request to the replica chosen for it (see the module docstring)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        # id(metadata) -> its request; the entry's `metadata is` check guards a reused id
        self._pending_by_metadata: dict[int, PendingRequest] = {}
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _add_pending_request_to_indices(self, pending_request: PendingRequest) -> None:
        super()._add_pending_request_to_indices(pending_request)
        self._pending_by_metadata[id(pending_request.metadata)] = pending_request

    def _remove_pending_request_from_indices(self, pending_request: PendingRequest) -> None:
        super()._remove_pending_request_from_indices(pending_request)
        key = id(pending_request.metadata)
        if self._pending_by_metadata.get(key) is pending_request:
            del self._pending_by_metadata[key]

    def _fulfill_next_pending_request(
        self,
        replica: RunningReplica,
        request_metadata: RequestMetadata | None = None,
    ) -> None:
        """Give `replica` to the waiting request whose metadata is `request_metadata`; if that
        request is done or gone (cancelled), to no one."""
        if request_metadata is None:
            return
        pending = self._pending_by_metadata.get(id(request_metadata))
        if pending is None or pending.metadata is not request_metadata or pending.future.done():
            return
        self._cancel_routing_task_for_pending_request(pending)
        self._record_queue_wait_time(pending)
        pending.future.set_result(replica)
        self._remove_pending_request_from_indices(pending)
