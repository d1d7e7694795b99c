"""Test-only fault injection: make one engine stage raise for one batch, on purpose.

A fault-tolerance claim ("one bad batch fails its own requests, frees their blocks, and the
engine keeps serving") is only worth what its test is worth, and a test needs a way to make
the model step, the sampler or the detokenizer fail at a chosen moment. This module is
that way. It is off unless a test installs a :class:`FaultInjector` on the engine
(``engine.set_fault_injector``) or the environment names one:

    PAGEDLLM_FAULT_INJECTION="sampler@3"              # the 3rd sampler call raises, once
    PAGEDLLM_FAULT_INJECTION="model@2,detokenizer@5"  # several rules, comma separated
    PAGEDLLM_FAULT_INJECTION="model@prompt~XYZZY"     # every batch holding a request whose
                                                       # prompt text contains XYZZY
    PAGEDLLM_FAULT_INJECTION="model@delay~0.05"       # no error: every forward pass takes
                                                       # 50 ms longer (a slow model, for load tests)

Sites: ``model`` (raised inside the forward pass, half-way through the layers, after some
KV has been written), ``sampler`` (after the forward pass, before sampling), ``detokenizer``
(per request, before its new token is detokenized), and ``core`` (the engine step itself,
outside any batch: the engine's state is then untrusted and it stops).

Off, the production cost is one ``is None`` test per stage per step.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

from torch import nn

from pagedllm.engine.sequence import Sequence

ENV_VAR = "PAGEDLLM_FAULT_INJECTION"
SITES = ("model", "sampler", "detokenizer", "core")


def _seconds(item: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{ENV_VAR} item {item!r}: {text!r} is not a number of seconds") from None


class InjectedFault(RuntimeError):
    """The exception a fault-injection rule raises."""


@dataclass
class FaultRule:
    """Raise at the ``call``-th call of ``site`` (once), or on every batch whose prompts
    contain ``marker``; or, with ``delay``, raise nothing but sleep that long at every call."""

    site: str
    call: int | None = None
    marker: str | None = None
    delay: float | None = None
    fired: int = 0

    def __post_init__(self) -> None:
        if self.site not in SITES:
            raise ValueError(f"fault-injection site {self.site!r} is unknown (sites: {', '.join(SITES)})")
        if sum(x is not None for x in (self.call, self.marker, self.delay)) != 1:
            raise ValueError("a fault-injection rule needs exactly one of a call number, a marker "
                             "or a delay")
        if self.delay is not None and not 0 <= self.delay <= 60:
            raise ValueError(f"fault-injection delay must be in [0, 60] seconds, got {self.delay}")
        if self.call is not None and self.call < 1:
            raise ValueError(f"fault-injection call number must be >= 1, got {self.call}")


class FaultInjector:
    """Counts the calls of each site and raises :class:`InjectedFault` where a rule says so."""

    def __init__(self, rules: Seq[FaultRule]) -> None:
        self.rules = list(rules)
        self.calls = dict.fromkeys(SITES, 0)
        # Prompt text of a sequence, for marker rules; the engine sets its tokenizer's decode.
        self.decode: Callable[[list[int]], str] | None = None
        self.batch: list[Sequence] = []  # the batch being run, for the model-site hook
        self._hook: object | None = None

    @classmethod
    def parse(cls, spec: str) -> "FaultInjector":
        """Rules from ``site@N`` / ``site@prompt~MARKER`` / ``site@delay~SECONDS`` items
        separated by commas."""
        rules = []
        for item in filter(None, (part.strip() for part in spec.split(","))):
            site, sep, when = item.partition("@")
            if not sep:
                raise ValueError(f"{ENV_VAR} item {item!r} is not site@N, site@prompt~MARKER "
                                 f"or site@delay~SECONDS")
            if when.startswith("prompt~"):
                rules.append(FaultRule(site, marker=when.removeprefix("prompt~")))
            elif when.startswith("delay~"):
                rules.append(FaultRule(site, delay=_seconds(item, when.removeprefix("delay~"))))
            elif when.isdigit():
                rules.append(FaultRule(site, call=int(when)))
            else:
                raise ValueError(f"{ENV_VAR} item {item!r}: {when!r} is not a call number, "
                                 f"prompt~MARKER or delay~SECONDS")
        return cls(rules)

    @classmethod
    def from_env(cls) -> "FaultInjector | None":
        spec = os.environ.get(ENV_VAR, "").strip()
        return cls.parse(spec) if spec else None

    def check(self, site: str, seqs: Seq[Sequence] = ()) -> None:
        """Count one call of ``site`` on the batch ``seqs``; raise if a rule fires."""
        self.calls[site] += 1
        n = self.calls[site]
        for rule in self.rules:
            if rule.site != site:
                continue
            if rule.delay is not None:
                rule.fired += 1
                time.sleep(rule.delay)
            elif rule.call is not None and rule.call == n:
                rule.fired += 1
                raise InjectedFault(f"injected fault in {site} (call {n})")
            elif rule.marker is not None and self._any_prompt_contains(seqs, rule.marker):
                rule.fired += 1
                raise InjectedFault(f"injected fault in {site} (prompt marker {rule.marker!r})")

    def _any_prompt_contains(self, seqs: Seq[Sequence], marker: str) -> bool:
        if self.decode is None:
            return False
        return any(marker in self.decode(seq.prompt_token_ids) for seq in seqs)

    def install(self, model: nn.Module) -> None:
        """Make the ``model`` site fire inside ``model``'s forward pass, half-way through its
        layers, so a failing batch has already written part of its KV cache."""
        if not any(rule.site == "model" for rule in self.rules):
            return
        layer_lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
        target: nn.Module = model
        if layer_lists:
            layers = max(layer_lists, key=len)
            target = layers[len(layers) // 2]
        self._hook = target.register_forward_pre_hook(lambda module, args: self.check("model", self.batch))

    def uninstall(self) -> None:
        if self._hook is not None:
            self._hook.remove()  # type: ignore[attr-defined]
            self._hook = None
