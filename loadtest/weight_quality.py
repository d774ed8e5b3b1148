"""How far each weight form's tokens and logprobs are from the float path's, and llama.cpp's (#32).

    python -m loadtest.weight_quality [--forms int4,int8,int4:float32] [--peer llamacpp] [--chat-tokens 40]

Two workloads, both greedy: the peer benchmark's (loadtest/peer.py: a 512-token prompt, then 30
micro-turns of 32 token ids in and 8 out, each engine fed its own outputs back) and SmolLM2's chat
prompts below (`--chat-tokens` each). A form's KV pool is what `--kv-dtype auto` gives it
(worker/attention/kv_dtype.py), or the one after a colon (`int4:float16`, `int4:int8-keys`,
`int4:int8`). The torch reference attends, but on the int8 forms, which only the cpu kernel reads.
For every form, and for llama.cpp when installed:

- greedy agreement: how many generated tokens equal the float path's, position by position (a
  continuation diverges for good after its first differing token, so these counts swing);
- logprob difference: along the float path's own sequence (teacher-forced, so divergence does not
  compound), the logprob each engine gives the float path's chosen token, minus the float path's:
  mean |difference| and the largest, over every generated position.

The model runs in-process on the paged torch backend, one whole prompt then one-token steps, as a
session does (the engine's promise makes that the served tokens, whatever the chunking).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loadtest.peer import INSTALL_HINT, PeerWorkload, peer_llama, workload_ids

logger = logging.getLogger(__name__)

CHAT_PROMPTS = (
    "Name three rivers in Europe.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Give me a tip for learning to code.",
    "What does a CPU do?",
)
_PAGE = 16
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Sequences:
    """One engine's greedy outputs on both workloads (turn by turn, prompt by prompt)."""

    peer: list[list[int]]
    chat: list[list[int]]


class FormModel:
    """One weight form of the model with a paged KV pool of its own: feed tokens, get logits."""

    def __init__(self, model: str, form: str, max_tokens: int, kv_dtype: str = "auto") -> None:
        from worker.attention import paged_attention
        from worker.attention.kv_dtype import choose_kv_form
        from worker.model.llama import LlamaModel
        from worker.model.loader import load_model

        loaded = load_model(model, device=_CPU, dtype=torch.float32, weights=form)
        kv_form = choose_kv_form(kv_dtype, device=_CPU, dtype=torch.float32, weight_form=loaded.weights.form)
        config = loaded.config
        shape = kv_form.attention_shape(config, device=_CPU, dtype=torch.float32, page_size=_PAGE)
        self.tokenizer = loaded.tokenizer
        self.model = LlamaModel(config, loaded.weights, device=_CPU, dtype=torch.float32)
        pages = -(-max_tokens // _PAGE)
        # The torch reference, but on the int8 forms: only the cpu kernel reads them.
        backend_name = "cpu" if kv_form.int8_keys else "torch"
        self.attention = paged_attention(backend_name, shape, num_layers=config.num_layers, num_pages=pages)
        self.pages = list(range(pages))
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def feed(self, tokens: Sequence[int], every: bool = False) -> torch.Tensor:
        """float32 logits of the last fed token [vocab], or of every one [len(tokens), vocab]."""
        from worker.attention.base import paged_metadata

        count = len(tokens)
        self.attention.plan(paged_metadata([self.length], [count], [self.pages], _PAGE))
        positions = torch.arange(self.length, self.length + count)
        hidden = self.model.forward(torch.tensor(list(tokens), dtype=torch.int64), positions, self.attention)
        self.length += count
        return self.model.logits(hidden if every else hidden[-1:])

    def generate(self, tokens: Sequence[int], outputs: int) -> list[int]:
        produced: list[int] = []
        logits = self.feed(tokens)
        for _ in range(outputs):
            produced.append(int(logits.argmax(dim=-1)[-1]))
            if len(produced) < outputs:
                logits = self.feed(produced[-1:])
        return produced


def _chat_ids(model: FormModel) -> list[list[int]]:
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError("the chat workload needs the model's tokenizer")
    return [tokenizer.encode(tokenizer.chat_prompt(text)) for text in CHAT_PROMPTS]


def greedy(model: FormModel, peer: PeerWorkload, chat: list[list[int]], chat_tokens: int) -> Sequences:
    model.reset()
    pending: list[int] = []
    peer_out = []
    model.feed(workload_ids(peer.prompt_tokens, 0))
    for turn in range(peer.turns):
        reply = model.generate([*pending, *workload_ids(peer.chunk, turn + 1)], peer.outputs)
        pending = reply[-1:]
        peer_out.append(reply)
    chat_out = []
    for prompt in chat:
        model.reset()
        chat_out.append(model.generate(prompt, chat_tokens))
    return Sequences(peer_out, chat_out)


def _peer_sequence(peer: PeerWorkload, outputs: list[list[int]]) -> tuple[list[int], list[int]]:
    """The whole token sequence of the peer workload with these outputs, and the index of the logits
    row that predicted each output (every output but a turn's last is fed back within the turn)."""
    sequence = list(workload_ids(peer.prompt_tokens, 0))
    predicting: list[int] = []
    for turn, reply in enumerate(outputs):
        sequence += workload_ids(peer.chunk, turn + 1)
        for token in reply:
            predicting.append(len(sequence) - 1)
            sequence.append(token)
    return sequence, predicting


def _chosen_logprobs(logits: torch.Tensor, rows: Sequence[int], chosen: Sequence[int]) -> torch.Tensor:
    logprobs = torch.log_softmax(logits[list(rows)].double(), dim=-1)
    return logprobs.gather(1, torch.tensor(list(chosen)).unsqueeze(1)).squeeze(1)


def teacher_forced(
    logits_of: Any, peer: PeerWorkload, reference: Sequences, chat: list[list[int]]
) -> torch.Tensor:
    """Logprobs of the reference's chosen tokens at every generated position; `logits_of(tokens)`
    returns float logits of every position of a fresh sequence."""
    sequence, rows = _peer_sequence(peer, reference.peer)
    parts = [_chosen_logprobs(logits_of(sequence), rows, [t for reply in reference.peer for t in reply])]
    for prompt, reply in zip(chat, reference.chat, strict=True):
        tokens = [*prompt, *reply]
        rows = list(range(len(prompt) - 1, len(tokens) - 1))
        parts.append(_chosen_logprobs(logits_of(tokens), rows, reply))
    return torch.cat(parts)


def _agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    return f"{same}/{sum(len(r) for r in a)}"


def _difference(logprobs: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    delta = (logprobs - reference).abs()
    return {"mean_abs": round(float(delta.mean()), 4), "max_abs": round(float(delta.max()), 4)}


def run(model: str, forms: Sequence[str], llamacpp: bool, chat_tokens: int) -> dict[str, Any]:
    peer = PeerWorkload(model=model)
    max_tokens = peer.prompt_tokens + peer.turns * (peer.chunk + peer.outputs) + _PAGE
    reference_model = FormModel(model, "float", max_tokens)
    chat = _chat_ids(reference_model)

    def whole(engine: FormModel) -> Any:
        def logits_of(tokens: Sequence[int]) -> torch.Tensor:
            engine.reset()
            return engine.feed(tokens, every=True)

        return logits_of

    reference = greedy(reference_model, peer, chat, chat_tokens)
    reference_logprobs = teacher_forced(whole(reference_model), peer, reference, chat)
    del reference_model
    result: dict[str, Any] = {
        "model": model,
        "workloads": f"peer {peer.turns}x{peer.outputs}, chat {len(chat)}x{chat_tokens}",
        "forms": {},
    }
    for form in forms:
        weights, _, kv_dtype = form.partition(":")
        engine = FormModel(model, weights, max_tokens, kv_dtype or "auto")
        outputs = greedy(engine, peer, chat, chat_tokens)
        result["forms"][form] = {
            "peer_agreement": _agreement(outputs.peer, reference.peer),
            "chat_agreement": _agreement(outputs.chat, reference.chat),
            "logprob_difference": _difference(
                teacher_forced(whole(engine), peer, reference, chat), reference_logprobs
            ),
        }
        logger.info("%s: %s", form, result["forms"][form])
    if llamacpp:
        result["llamacpp"] = _llamacpp(
            model, peer, reference, reference_logprobs, chat=chat, chat_tokens=chat_tokens
        )
    return result


def _llamacpp(
    model: str,
    peer: PeerWorkload,
    reference: Sequences,
    reference_logprobs: torch.Tensor,
    *,
    chat: list[list[int]],
    chat_tokens: int,
) -> dict[str, Any]:
    llm = peer_llama(model, peer.threads, logits_all=True)
    peer_out = []
    llm.restart()
    llm.feed(workload_ids(peer.prompt_tokens, 0), 0)
    for turn in range(peer.turns):
        peer_out.append(llm.feed(workload_ids(peer.chunk, turn + 1), peer.outputs))
    chat_out = []
    for prompt in chat:
        llm.restart()
        chat_out.append(llm.feed(prompt, chat_tokens))

    def logits_of(tokens: Sequence[int]) -> torch.Tensor:
        return torch.from_numpy(llm.logits_of(tokens))

    return {
        "peer_agreement": _agreement(peer_out, reference.peer),
        "chat_agreement": _agreement(chat_out, reference.chat),
        "logprob_difference": _difference(
            teacher_forced(logits_of, peer, reference, chat), reference_logprobs
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.weight_quality", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--forms", default="int4,int8", help="comma-separated forms to hold to float (FORM or FORM:KV_DTYPE)"
    )
    parser.add_argument("--peer", choices=("llamacpp", "none"), default="llamacpp")
    parser.add_argument("--chat-tokens", type=int, default=40)
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (the tokens do not depend on them)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    llamacpp = args.peer == "llamacpp"
    if llamacpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print(f"llama.cpp left out: it needs llama-cpp-python: {INSTALL_HINT}", file=sys.stderr)
            llamacpp = False
    forms = [form for form in args.forms.split(",") if form]
    print(json.dumps(run(args.model, forms, llamacpp, args.chat_tokens), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
