"""The `pagedllm` command: generate, chat, serve, bench."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from pagedllm.config import EngineConfig


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace) -> "SamplingParams":
    from pagedllm.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or HF directory (default: bundled SmolLM2-135M-Instruct)")
    EngineConfig.add_cli_args(p.add_argument_group("engine"))


def _engine_kwargs(args: argparse.Namespace) -> dict:
    config = EngineConfig.from_cli_args(args, model=args.model)
    return {k: v for k, v in vars(config).items() if k != "model"}


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.llm import LLM
    sp = _sampling_params(args)
    llm = LLM(args.model, **_engine_kwargs(args))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], sp,
                           use_tqdm=not args.quiet)
    else:
        outputs = llm.generate(args.prompts, sp, use_tqdm=not args.quiet)
    for out in outputs:
        if len(outputs) > 1:
            print(f"--- {out.prompt!r}")
        print(out.text if args.chat else out.prompt + out.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.chat import run_chat
    return run_chat(args, _sampling_params(args), _engine_kwargs(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedllm.bench.main import run_bench
    return run_bench(args, args.argv[1:])


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import ServerConfig, bind_socket, run_server
    from pagedllm.logger import init_logging
    init_logging()
    model = args.model_path or args.model
    server = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=args.served_model_name,
                          max_body_bytes=args.max_body_bytes,
                          max_waiting_requests=args.max_waiting_requests,
                          keep_alive_on_engine_death=args.keep_alive_on_engine_death,
                          tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser, pooling=args.pooling)
    sock = bind_socket(server)  # before the model loads: a port in use fails at once
    try:
        engine = AsyncLLM.from_config(EngineConfig.from_cli_args(args, model=model),
                                      max_waiting_requests=server.max_waiting_requests)
        return run_server(engine, server, server.served_model_name or _model_name(model), sock)
    finally:
        sock.close()


def _model_name(model: str | None) -> str:
    """The file or directory name, e.g. SmolLM2-135M-Instruct.Q4_1 for the bundled model."""
    import os
    from pagedllm.loader import default_model_path
    name = os.path.basename(os.path.normpath(model or default_model_path()))
    return name.removesuffix(".gguf")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai.reasoning import PARSERS as REASONING_PARSERS
    from pagedllm.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS
    p.add_argument("model_path", nargs="?", default=None, metavar="PATH",
                   help="GGUF file or HF directory (default: the bundled SmolLM2-135M-Instruct)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on the API (not on /health)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model's name)")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="waiting requests beyond which new ones get 503 + Retry-After (default: 256)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted; larger ones get 413 (default: 1 MiB)")
    g.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="if the engine dies, keep answering 503 instead of exiting with code 1 "
                        "(the default, so that a supervisor restarts the server)")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the tool-call format of the model's output (default: the one its chat "
                        "template teaches; hermes where it teaches none)")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split <think>...</think> into the message's reasoning_content "
                        "(qwen3: the model opens <think>; deepseek_r1: the template does)")
    g.add_argument("--pooling", choices=["last", "mean"], default="last",
                   help="how /v1/embeddings pools the prompt's final hidden states (default: "
                        "the last token's); embeddings are L2-normalised")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts and print the text")
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_sampling_args(gen, max_tokens=64)
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, max_tokens=512)
    _add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", conflict_handler="resolve",
                           help="benchmark pagedllm and its peers (HF, llama.cpp) side by side; "
                                "`pagedllm bench soak --help`: load and leak test of a server")
    from pagedllm.bench.main import add_bench_args
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with a live KV-cache page")
    _add_serve_args(serve)
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv[:2] == ["bench", "soak"]:  # the soak test has its own options (a server, clients)
        from pagedllm.bench.soak import main as soak_main
        return soak_main(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
