"""Whether a node offers new shared jobs, from its GPUs' withheld flags: the rule the node agent applies
(gpushare.node.withhold toggles the node feature) and the simulator replays."""

from __future__ import annotations

from typing import Iterable


def node_open(withheld: Iterable[bool], when: str) -> bool:
    """Whether the node should accept new shared jobs, from each GPU's withheld flag (pure).

    ``when`` is ``[agent] withhold_node_when``: ``"any"`` closes the node while any GPU is withheld,
    ``"all"`` only while every GPU is."""
    flags = list(withheld)
    if not flags:
        return True
    if when == "all":
        return not all(flags)
    return not any(flags)
