"""A callback that records what the engine options did inside a real run (named in a test
config's ``callbacks`` list): each rank writes ``probe-rank<N>.json`` into the run folder."""

from __future__ import annotations

import json

import torch

from ddp_hpc.training import Callback


class EngineProbe(Callback):
    """Per rank: its share of the optimizer state (ZeRO), the EMA it predicts from the live
    weights after every step against the trainer's, which model evaluation ran on, the
    communication hook DDP reports, and the dtype of the Linear layers' outputs in training."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.predicted: list[torch.Tensor] | None = None
        self.evaluated: list[str] = []
        self.activations: set[str] = set()

    def on_fit_start(self, trainer) -> None:
        evaluate = trainer.job.eval_step

        def recording(model, batch):
            ema = trainer.ema.module if trainer.ema is not None else None
            self.evaluated.append("ema" if model is ema else "live" if model is trainer.model else "other")
            return evaluate(model, batch)

        trainer.job.eval_step = recording

        def record_dtype(module, inputs, output) -> None:
            if module.training:
                self.activations.add(str(output.dtype))

        for module in trainer.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(record_dtype)

    def on_step_end(self, trainer) -> None:
        live = [p.detach().float().clone() for p in trainer.model.parameters()]
        if self.predicted is None:  # AveragedModel copies the weights at its first update
            self.predicted = live
        else:
            self.predicted = [self.decay * e + (1 - self.decay) * p for e, p in zip(self.predicted, live)]

    def on_fit_end(self, trainer, summary) -> None:
        live = [p.detach().float() for p in trainer.model.parameters()]
        ema = [p.detach().float() for p in trainer.ema.module.parameters()] if trainer.ema is not None else []
        optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeroRedundancyOptimizer's local one
        local_state = sum(t.numel() for state in optimizer.state.values() for t in state.values()
                          if torch.is_tensor(t) and t.dim() > 0)
        logging_data = trainer.ddp_model._get_ddp_logging_data() if hasattr(trainer.ddp_model,
                                                                             "_get_ddp_logging_data") else {}
        facts = {
            "rank": trainer.ctx.rank,
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "optimizer_class": type(trainer.optimizer).__name__,
            "local_optimizer_state": local_state,
            "ema_minus_predicted": max((float((e - q).abs().max()) for e, q in zip(ema, self.predicted or [])),
                                       default=None),
            "ema_minus_live": max((float((e - p).abs().max()) for e, p in zip(ema, live)), default=None),
            "evaluated": sorted(set(self.evaluated)),
            "comm_hook": str(logging_data.get("comm_hook", "")),
            "training_activations": sorted(self.activations),
        }
        (trainer.run.path / f"probe-rank{trainer.ctx.rank}.json").write_text(json.dumps(facts))
