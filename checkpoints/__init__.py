"""Trained tiny checkpoints (``ess_jax.config.CHECKPOINTS``), one directory each: config.json,
model.safetensors, tokenizer.json and train.json (the recipe, the data and the held-out perplexity
measured when they were trained).

``demo_prompt.txt`` (``make demo``'s prompt) is the first 9.8 KB of ``textwrap.py`` of the CPython 3.13.0
standard library (PSF License), a module the training corpus holds out. ``heldout_code.txt`` (the held-out
perplexity's text, ``bench``'s prompts for these checkpoints) is the first held-out documents (``csv.py``,
``fractions.py``) that ``tools/build_corpus.py --heldout-text`` writes, from the same library.
"""
