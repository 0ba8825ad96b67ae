"""A recipe's model name resolved to the full-size preset it names: :func:`preset_name`.

MaxText names its model with ``model_name`` (a file of ``src/maxtext/configs/models/``), torchtitan with ``[model]
name`` and ``flavor`` (a key of ``torchtitan/models/<name>/__init__.py``'s configs), which a
:class:`~workbench.core.interop.recipe.TrainingRecipe` keeps as ``"name/flavor"``. Each maps to a published
``config.json`` in :mod:`workbench.core.models.presets`, so a recipe builds and prices its model without the user
looking up the config.

>>> preset_name("llama3.1-70b"), preset_name("llama3/8B")
('llama-3.1-70b', 'llama-3.1-8b')
"""

from __future__ import annotations

from workbench.core.models.presets import FULL_SIZE, full_config_dict

# MaxText model_name -> preset: the files of AI-Hypercomputer/maxtext src/maxtext/configs/models/ (at commit
# e591f30cbbf217ed67ef71263ec0538239f9c3b8) whose shapes are a preset's.
MAXTEXT_MODELS = {
    "llama2-70b": "llama-2-70b",
    "llama3-8b": "llama-3-8b",
    "llama3-70b": "llama-3-70b",
    "llama3-405b": "llama-3.1-405b",  # the same file as llama3.1-405b.yml
    "llama3.1-8b": "llama-3.1-8b",
    "llama3.1-70b": "llama-3.1-70b",
    "llama3.1-405b": "llama-3.1-405b",
    "mixtral-8x7b": "mixtral-8x7b",
    "mixtral-8x22b": "mixtral-8x22b",
    "qwen3-8b": "qwen3-8b",
    "qwen3-32b": "qwen3-32b",
    "qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen3-235b-a22b": "qwen3-235b-a22b",
    "deepseek3-671b": "deepseek-v3",
}
# torchtitan "name/flavor" -> preset: pytorch/torchtitan torchtitan/models/<name>/__init__.py (commit b5bcd76c).
# Its llama3 flavors are Llama 3.1's (their rope is scaled, "llama" scaling, and they load Llama-3.1 checkpoints).
TORCHTITAN_MODELS = {
    "llama3/8B": "llama-3.1-8b",
    "llama3/70B": "llama-3.1-70b",
    "llama3/405B": "llama-3.1-405b",
    "qwen3/8B": "qwen3-8b",
    "qwen3/32B": "qwen3-32b",
    "qwen3/30B-A3B": "qwen3-30b-a3b",
    "qwen3/235B-A22B": "qwen3-235b-a22b",
    "deepseek_v3/671B": "deepseek-v3",
}
_BY_KEY = {name.lower(): preset for name, preset in {**MAXTEXT_MODELS, **TORCHTITAN_MODELS}.items()}
_BY_KEY.update({preset: preset for preset in FULL_SIZE})


def preset_name(model: str) -> str:
    """The full-size preset (a name of :func:`~workbench.core.models.presets.full_config`) that ``model`` names:
    MaxText's ``model_name`` (``"llama3.1-70b"``), torchtitan's ``"name/flavor"`` (``"llama3/70B"``) or a preset's
    own name, in any case. A ValueError lists the names known when ``model`` is none of them."""
    if not isinstance(model, str):
        raise TypeError(f"a model name is a string such as 'llama3.1-70b' or 'llama3/70B'; got {type(model).__name__}")
    preset = _BY_KEY.get(model.strip().lower())
    if preset is None:
        raise ValueError(f"no full-size preset for the model {model!r}. Known: MaxText model_name "
                         f"{sorted(MAXTEXT_MODELS)}; torchtitan name/flavor {sorted(TORCHTITAN_MODELS)}; presets "
                         f"{list(FULL_SIZE)}. Otherwise pass the model's config (ModelConfig.from_hf of its "
                         f"config.json)")
    return preset


def preset_layers(model: str | None) -> int | None:
    """The decoder layers of the preset ``model`` names, or None when it names none (a reader then asks for them)."""
    if model is None or model.strip().lower() not in _BY_KEY:
        return None
    config = full_config_dict(preset_name(model))
    return config.get("num_hidden_layers", config.get("n_layer"))
