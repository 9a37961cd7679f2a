"""The controller's book of nodes (launcher.control.node_book): a loss's report and its line."""

from __future__ import annotations

import pytest

from launcher.control.controller_settings import ControllerHooks, ControllerSettings
from launcher.control.controller_state import ControllerState
from launcher.control.node_book import NodeBook
from launcher.observe.logs import AgentLog, read_event_file
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


def book(tmp_path, chain: tuple[str, ...], aware: bool) -> NodeBook:
    """Two nodes of two ranks; the log in `tmp_path/events.jsonl`."""
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    settings = ControllerSettings(4, 2, 3, chain, node_replace_timeout=270.0, min_nodes=1)
    nodes = NodeBook(LocalKV(), log, settings, ControllerHooks(), ControllerState(), lambda: None)
    nodes.aware = lambda: aware
    return nodes


def reported(tmp_path) -> str:
    (line,) = [
        e for e in read_event_file(str(tmp_path / "events.jsonl")) if e["event"] == "fault-reported"
    ]
    return line["message"]


@pytest.mark.parametrize("aware", [True, False])
def test_a_loss_with_the_at_once_chain_says_its_ranks_leave_at_once(tmp_path, aware) -> None:
    """--recover-strategy elastic-training: the `decide` line after says the ranks leave the
    world at once; the report's line says the same (not the wait of the waiting rule)."""
    nodes = book(tmp_path, (P.ELASTIC, P.RESTART_ALL, P.EXIT), aware)
    nodes.note_node(1, lost=True, why="no heartbeat for 2s")
    text = reported(tmp_path)
    assert text.startswith("node 1 lost (no heartbeat for 2s): reported as fault #1; ")
    if aware:
        assert "its ranks [2, 3] leave the world at once" in text and "wait up to" not in text
    else:  # unmodified workers cannot shrink live: the loss waits for a takeover
        assert "its ranks [2, 3] wait up to node_replace_timeout=270s" in text
        assert "leave the world" not in text


def test_a_loss_with_recover_in_place_first_waits_for_a_takeover(tmp_path) -> None:
    nodes = book(tmp_path, (P.RECOVER_IN_PLACE, P.ELASTIC, P.RESTART_ALL), True)
    nodes.note_node(1, lost=True, why="no heartbeat for 2s")
    text = reported(tmp_path)
    assert text.endswith(
        "its ranks [2, 3] wait up to node_replace_timeout=270s for a hot spare or a "
        "replacement agent"
    )
    assert nodes.lost_nodes == {1} and nodes.live_nodes() == 1


def test_the_outlook_counts_a_loss_not_noted_yet_out_of_the_nodes_left(tmp_path) -> None:
    """The agent's `node-lost` line comes before the loss is noted: with --nnodes MIN=2 of 2 the
    world may not shrink, so the ranks wait."""
    log = AgentLog(0, None, quiet=True)
    settings = ControllerSettings(4, 2, 3, (P.ELASTIC, P.RESTART_ALL), min_nodes=2)
    nodes = NodeBook(LocalKV(), log, settings, ControllerHooks(), ControllerState(), lambda: None)
    nodes.aware = lambda: True
    assert nodes.outlook([2, 3]).startswith("its ranks [2, 3] leave the world at once")
    assert nodes.outlook([2, 3], lost=1).startswith("its ranks [2, 3] wait up to")
