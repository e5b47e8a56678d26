"""The dispatch-mode counter of host-blocking operations (``kvcompress.metrics.host_syncs``): what it counts,
what it does not, and that it leaves ``Tensor.tolist`` as it found it."""

from __future__ import annotations

import torch

from kvcompress.metrics.host_syncs import HostSyncs


def test_it_counts_reads_data_shaped_results_and_host_data_by_kind():
    x = torch.arange(6.0)
    original = torch.Tensor.tolist
    with HostSyncs() as syncs:
        x.sum().item()  # read back
        bool(x[0] > 1)  # read back
        x.tolist()  # read back, without an aten op
        x.nonzero()  # data-shaped
        x[x > 2]  # boolean-mask index: data-shaped
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long))  # by a tensor: data-shaped
        torch.tensor([1, 2])  # from host data
        x + 1, x.index_select(0, torch.arange(2)), x.repeat_interleave(2)  # none of these
    assert dict(syncs.kinds) == {"read_back": 3, "data_shaped": 3, "from_host": 1}
    assert syncs.total == 7 and sum(syncs.lines.values()) == 7
    assert torch.Tensor.tolist is original


def test_it_names_the_kvcompress_line_that_asked():
    """A forward's padding check reads one value back (``bool(new.all())``): counted at that line."""
    from kvcompress.core.attention import ForwardState

    state = ForwardState(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    with HostSyncs() as syncs:
        valid = state.new_token_validity(2, 3, "cpu")
    assert valid is not None and dict(syncs.kinds) == {"read_back": 1}
    ((line, n),) = syncs.lines.items()
    assert line.startswith("kvcompress/core/attention.py:") and n == 1


def test_it_counts_python_numbers_read_under_inference_mode_once_each():
    """Under ``inference_mode`` a CPU tensor's ``item``/``int``/``float`` skip the dispatcher: the wrapped
    methods still count them, once each (not again through the aten op) and in ordinary mode too."""
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            x = torch.arange(6.0)
            with HostSyncs() as syncs:
                x.sum().item()
                int(x.sum())
                float(x.max())
                [0, 1, 2][x[1].long()]  # __index__
            assert dict(syncs.kinds) == {"read_back": 4}, mode
