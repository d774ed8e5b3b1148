"""Chat templates render as transformers renders them, and a template a session cannot stream turn
by turn is found at load."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from transformers import PreTrainedTokenizerFast

from shared.chat_template import ChatTemplate
from worker.model.loader_hf import hf_chat_template
from worker.model.presets import smollm2_gguf_path
from worker.tokenizer.gguf import tokenizer_from_gguf

CONVERSATION = [
    {"role": "user", "content": "Bonjour, ça va ?"},
    {"role": "assistant", "content": "Oui."},
    {"role": "user", "content": 'Say "hi"\nthen stop.'},
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[ChatTemplate, PreTrainedTokenizerFast]:
    tokenizer = tokenizer_from_gguf(gguf.GGUFReader(str(smollm2_gguf_path())))
    template = tokenizer.chat_template
    assert template is not None and template.eos_token == "<|im_end|>"
    reference = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend,
        chat_template=template.source,
        bos_token=template.bos_token,
        eos_token=template.eos_token,
    )
    return template, reference


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_smollm2s_template_renders_as_transformers_renders_it(
    smollm2: tuple[ChatTemplate, PreTrainedTokenizerFast], generation_prompt: bool
) -> None:
    template, reference = smollm2
    want = reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=generation_prompt
    )
    assert template.render(CONVERSATION, add_generation_prompt=generation_prompt) == want


def test_smollm2s_template_extends_turn_by_turn(
    smollm2: tuple[ChatTemplate, PreTrainedTokenizerFast],
) -> None:
    assert smollm2[0].check_extends() is None


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        # The last message marked: every rendering rewrites the one before.
        (
            "{% for m in messages %}{% if loop.last %}>>{% endif %}{{ m.content }}\n{% endfor %}",
            "does not extend",
        ),
        # The generation prompt is not where an assistant turn starts.
        (
            "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[bot] {% endif %}",
            "generation prompt",
        ),
        ("{{ raise_exception('no system role') }}", "does not render"),
    ],
)
def test_a_template_that_rewrites_earlier_turns_is_reported(source: str, problem: str) -> None:
    found = ChatTemplate(source).check_extends()
    assert found is not None and problem in found


def test_an_hf_directory_gives_its_tokenizer_configs_template(tmp_path: Path) -> None:
    config = {
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = hf_chat_template(tmp_path)
    assert template is not None
    assert (
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "<s>a</s>b</s>"
    )
    (tmp_path / "empty").mkdir()
    assert hf_chat_template(tmp_path / "empty") is None
