"""A running request's request row, as the cache manager keeps it, and the checks of the token
ids a caller gives for it."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .base import PrefixCache, PrefixHandle, TokenArray
from .tree_node import as_token_array


@dataclass
class RunningRow:
    """The row's first ``handle.cached_len`` slots come from the locked prefix ``handle`` (in
    the ``extra_key`` namespace); it holds ``row_len`` slots in all."""

    handle: PrefixHandle
    extra_key: Hashable
    row_len: int

    def checked_key(self, row: int, token_ids: npt.ArrayLike, cache: PrefixCache) -> TokenArray:
        """``token_ids`` whose K/V the row holds, checked: no more than its slots, and starting
        with its cached prefix."""
        key = as_token_array(token_ids)
        if len(key) > self.row_len:
            raise ValueError(
                f"{len(key)} token ids given for request row {row}, which holds only "
                f"{self.row_len} slots"
            )
        cached_len = self.handle.cached_len
        if (
            cached_len
            and len(key) >= cached_len
            and not np.array_equal(key[:cached_len], cache.tokens_of(self.handle))
        ):
            raise ValueError(f"token ids for request row {row} do not start with its cached prefix")
        return key
