"""What every model family builds from: norms, rotary and causal/document attention, the SwiGLU FFN, the LM head's
loss, the document_ids convention, context parallelism's group and FLA's device check.

Here rather than in a family (models/k3, models/kda) so that each family, and the dense peer beside them, imports
only this package and never another family's internals (pyproject.toml's import-linter contract).
"""
