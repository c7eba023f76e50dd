"""What a user writing their own loop with the engine's parts meets first (issue 32): the
parts in a single process, the messages they log, the refusals of a corrupt checkpoint."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import ddp_hpc


def test_the_sampler_in_a_single_process_without_a_group_deals_everything_to_rank_0():
    assert not dist.is_initialized()
    data = TensorDataset(torch.arange(10))
    sampler = ddp_hpc.ResumableSampler(data, shuffle=False, batch_size=4)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)
    assert list(sampler) == list(range(10))


def test_the_sampler_names_the_epoch_it_continues_by_sampler_epoch(caplog):
    data = TensorDataset(torch.arange(96))
    old = ddp_hpc.ResumableSampler(data, 2, 0, shuffle=True, seed=5, batch_size=4)
    old.set_epoch(1)
    old.advance(3)
    new = ddp_hpc.ResumableSampler(data, 3, 0, shuffle=True, seed=5, batch_size=4)
    with caplog.at_level(logging.WARNING, logger="ddp_hpc.engine.sampler"):
        new.load_state_dict(old.state_dict())
    assert new.epoch == 1
    (message,) = [r.getMessage() for r in caplog.records if "continues on 3 ranks" in r.getMessage()]
    assert "epoch 1 (sampler.epoch, counted from 0) goes on after 24 of its samples" in message, message


def test_a_stop_names_what_caused_it_the_deadline_or_a_request(caplog):
    clock = [1000.0]
    by_deadline = ddp_hpc.StopAgreement(deadline=1100.0, margin_s=30.0, clock=lambda: clock[0])
    by_request = ddp_hpc.StopAgreement(deadline=None)
    with caplog.at_level(logging.WARNING, logger="ddp_hpc.engine.stop_agreement"):
        while not by_deadline.now():
            clock[0] += 10
        by_request.request()
        assert by_request.now()
    stops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopped")]
    assert stops == ["stopped ahead of the job deadline at step 8: rerun or requeue to resume",
                     "stopped on request at step 1: rerun or requeue to resume"], stops
