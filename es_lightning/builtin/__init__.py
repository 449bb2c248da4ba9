"""The built-in tiny model: a character-level Qwen2-config causal LM trained on the procedural tasks.

It exists so that every recipe, test and demo runs on a laptop CPU through exactly the loading code real models use
(``es_lightning.policy.load_policy``): ``builtin:countdown-tiny`` resolves to a Hugging Face directory inside this
package.
How it was made: ``recipes/builtin/pretrain.yaml`` (see ``es_lightning/builtin/pretrain.py`` and the README).
"""

from es_lightning.builtin.tokenizer import CHARSET, build_char_tokenizer

__all__ = ["CHARSET", "build_char_tokenizer"]
