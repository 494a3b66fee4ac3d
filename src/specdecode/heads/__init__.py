"""The tooling of draft heads: the ``specdecode heads`` command (:mod:`.cli`), the corpus
of the target's own answers (:mod:`.corpus`, ``specdecode heads corpus``) and training
(:mod:`.train`, ``specdecode heads train``). The drafter that uses trained heads, and
their file format, live in :mod:`specdecode.drafters.heads`."""
