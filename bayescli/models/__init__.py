"""Models as people publish them: specs, factories, checkpoint formats and the feature/head split.

* :mod:`~bayescli.models.specs` — model specs (``timm:``, ``torchvision:``, ``builtin:``, ``hf:``,
  ``py:``), factories and :func:`~bayescli.models.specs.load_classifier`;
* :mod:`~bayescli.models.classifier` — the classifier wrapper (normalisation, logits, feature/head
  split, output selection);
* :mod:`~bayescli.models.checkpoints` — checkpoint files read by content and matched by key;
* :mod:`~bayescli.models.unpickle` — the restricted unpickler (no code runs from a file);
* :mod:`~bayescli.models.hf` — Hugging Face ``save_pretrained`` folders;
* :mod:`~bayescli.models.args` — factory arguments and which of them a file may supply;
* :mod:`~bayescli.models.preprocess` — input preprocessing as part of the model;
* :mod:`~bayescli.models.features` — penultimate features ``φ(x)`` and logits, streamed.
"""
