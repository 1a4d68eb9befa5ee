"""zero-integrations: zero inside the trainers people already use.

``zero_integrations.hf`` (extra ``[hf]``) holds :class:`~zero_integrations.hf.ZeroTrainer`,
a HuggingFace ``Trainer`` that trains under zero; ``zero_integrations.accelerate`` (extra
``[accelerate]``) holds :func:`~zero_integrations.accelerate.prepare`, which puts an Accelerate
custom loop's model and optimizer under zero; ``zero_integrations.lightning`` (extra
``[lightning]``) holds :class:`~zero_integrations.lightning.ZeroStrategy`, registered in
Lightning as ``strategy="zero"`` when the module is imported. None is imported here,
so importing this package needs none of the frameworks.
"""

from zero_integrations._version import __version__

__all__ = ["__version__"]
