"""Optional integrations with other frameworks; the rest of gymckpt never imports them.

- :mod:`gymckpt.integrations.nemo_gym`: NeMo Gym servers and agents checkpointed by
  configuration (``pip install nemo-gym``, Python 3.12).
"""
