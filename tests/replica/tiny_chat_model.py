"""A tiny model directory with a real tokenizer and chat template, built by the test.

The tokenizer is a byte-level BPE trained with `tokenizers` on a few sentences, so
characters it never saw (an emoji, most CJK) come out as several byte tokens, each of
which decodes alone to U+FFFD: what incremental detokenization must get right.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A café in Paris serves coffee and croissants every morning.",
    "Hello world, hello there, and hello again to everyone here.",
    "Tokens become text one at a time while the model streams its answer.",
    "system user assistant: you are a helpful assistant.",
]
# A ChatML-like template: what apply_chat_template renders for the engine to continue.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 384  # the model's; the tokenizer's is at most this


def train_tokenizer(
    chat_template: str | None = CHAT_TEMPLATE,
) -> transformers.PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 16,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(SENTENCES, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def save_chat_model(
    directory: Path, chat_template: str | None = CHAT_TEMPLATE
) -> tuple[str, transformers.PreTrainedTokenizerFast, torch.nn.Module]:
    """A Qwen3 directory of seeded random weights with the trained tokenizer beside it."""
    tokenizer = train_tokenizer(chat_template)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = transformers.Qwen3Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=VOCAB_SIZE, max_position_embeddings=256,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(1234)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory), tokenizer, model
