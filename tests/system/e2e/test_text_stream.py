"""Through `microturn up` with SmolLM2: a ChatML question typed in 9-character pieces is the same
conversation as the whole question sent at once (issue 8).

Cut every 9 characters, `<|im_start|>` and `<|im_end|>` are split and "What is" loses its space to
the previous piece; tokenized piece by piece, the model saw another prompt and echoed the question.
The worker now holds back the text that could still change and commits exactly the whole text's
tokens, so the greedy replies are identical.
"""

from __future__ import annotations

import pytest

from shared.client.clients import SyncRealtimeClient
from tests.system.e2e.up import Up

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# A question SmolLM2 answers "The capital of France is Paris." by 1.4 logits or more at every token up to
# "Paris", behind its default system prompt, in every form served here (int4 with a float16 or a
# float32 KV pool, float); "What is the capital of France?" is there a near-tie (0.05-0.08 logits
# against "L'Étoile ..."), which any numeric change may tip (docs/benchmarks.md, "The KV pool in
# float16 for the quantised forms").
QUESTION = "Name the capital of France."
PROMPT = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
)
REPLY_TOKENS = 24


def test_chatml_in_nine_character_pieces_gets_the_whole_questions_reply(smollm2_up: Up) -> None:
    up = smollm2_up
    with SyncRealtimeClient.connect(up.ws, "msgpack") as client:
        client.open(max_output_tokens=0)
        whole = client.turn(1, text=PROMPT, max_output_tokens=REPLY_TOKENS)
        client.close()
    pieces = [PROMPT[i : i + 9] for i in range(0, len(PROMPT), 9)]
    with SyncRealtimeClient.connect(up.ws, "msgpack") as client:
        client.open(max_output_tokens=0)
        committed = 0
        for seq, piece in enumerate(pieces[:-1], start=1):
            done = client.turn(seq, text=piece)
            assert done.tokens == () and done.committed_tokens is not None
            committed += done.committed_tokens
        reply = client.turn(len(pieces), text=pieces[-1], max_output_tokens=REPLY_TOKENS)
        assert reply.committed_tokens is not None
        client.close()
    assert committed + reply.committed_tokens == whole.committed_tokens
    assert reply.tokens == whole.tokens and reply.text == whole.text
    assert "Paris" in (reply.text or ""), reply.text
