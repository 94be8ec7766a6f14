"""The embedded demo model: a tiny LLaVA trained on synthetic pictures, and the data it learns from.

``synthetic`` draws the pictures and questions (training, evaluation and tests share it);
``recipe`` says how the checkpoint is put together. The checkpoint itself ships in the
package, in ``DEMO_MODEL_DIR``.
"""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"
