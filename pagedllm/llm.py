"""LLM: the offline entry point. generate() and chat() over a batch of prompts."""
from __future__ import annotations

import time
from itertools import count
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine, Prompt
from pagedllm.logger import init_logging
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import PoolingParams, SamplingParams
from pagedllm.tokenizer import Tokenizer

Message = dict[str, str]


class LLM:
    """An engine for offline batched generation.

    >>> llm = LLM()  # the bundled SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0))[0].text
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        init_logging()
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = count()

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes now (otherwise at interpreter exit)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (as vLLM's): the next prompts are computed in full.
        False where it cannot (requests still running)."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come back in input order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        request_ids = []
        try:
            for prompt, sp in zip(prompts, params):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(request_id, prompt, sp)
                request_ids.append(request_id)
        except Exception:
            for request_id in request_ids:  # leave the engine as it was
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def beam_search(self, prompts: Prompt | Seq[Prompt], beam_width: int, max_tokens: int,
                    length_penalty: float = 1.0, early_stopping: bool | str = False,
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """Beam search of each prompt; each output holds beam_width hypotheses, best first,
        with their scores in extra["beam_scores"]. Beams share KV blocks (copy on write).
        Same selection as transformers' generate(num_beams=beam_width, do_sample=False,
        length_penalty=..., early_stopping=...)."""
        if not isinstance(beam_width, int) or isinstance(beam_width, bool) or beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {beam_width!r}")
        params = SamplingParams(n=beam_width, temperature=0.0, max_tokens=max_tokens,
                                use_beam_search=True, length_penalty=length_penalty,
                                early_stopping=early_stopping, ignore_eos=False)
        return self.generate(prompts, params, use_tqdm)

    def chat(self, messages: list[Message] | Seq[list[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them, via the chat template."""
        conversations = ([messages] if messages and isinstance(messages[0], dict)
                         else list(messages))  # type: ignore[arg-type]
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        # The template already holds any BOS token.
        token_prompts: list[Prompt] = [tok.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_prompts, sampling_params, use_tqdm)
        for out, prompt in zip(outputs, prompts):
            out.prompt = prompt
        return outputs

    def embed(self, prompts: Prompt | Seq[Prompt], pooling: str = "last", normalize: bool = True,
              use_tqdm: bool = True) -> list[list[float]]:
        """Each prompt's embedding: its final hidden states (after the final norm) pooled by
        the last token or the mean of all tokens, L2-normalised unless told not to."""
        params = SamplingParams(temperature=0, max_tokens=1,
                                pooling=PoolingParams(pooling, normalize))
        outputs = self.generate(prompts, params, use_tqdm)
        return [out.embedding for out in outputs]  # type: ignore[misc]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", dynamic_ncols=True,
                   disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            while len(finished) < len(request_ids):
                t = time.perf_counter()
                outputs = engine.step(final_only=True)
                seconds = time.perf_counter() - t
                step = engine.last_step
                if step.num_seqs:
                    rate = step.num_tokens / seconds
                    if step.is_prefill:
                        prefill_tps = rate
                    else:
                        decode_tps = rate
                    bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s",
                                    refresh=False)
                for out in outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                if not outputs and not engine.has_unfinished_requests():
                    break
        except BaseException:  # e.g. KeyboardInterrupt: free what this call still holds
            for request_id in request_ids:
                if request_id not in finished:
                    engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # a single prompt of token ids
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty string, list of strings or list of token-id lists")
    return list(prompts)
