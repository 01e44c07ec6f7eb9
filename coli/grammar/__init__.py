"""Grammar-constrained decoding with llguidance: JSON schemas, regular expressions, Lark
(and GBNF) grammars, and tool calls, on every model.

- ``constraint``: ``Constraint`` (what the answer must match) and ``Vocabulary`` (the
  model's tokenizer as llguidance sees it); ``GrammarError`` for what does not compile.
- ``guide``: one sequence's matcher, its token mask and forced tokens; ``MaskWorker``
  computes a step's masks while the engine runs it.
- ``hook``: the runner's small interface (``pick``, ``due``, ``finished``).
- ``tools``: tool calls as a grammar, and the generic tool format for chat templates
  without tool calling.
"""
from coli.grammar.constraint import Constraint, GrammarError, Vocabulary
from coli.grammar.guide import DeadEnd, Guide, MaskWorker

__all__ = ["Constraint", "DeadEnd", "GrammarError", "Guide", "MaskWorker", "Vocabulary"]
