"""KV slots: the scheduler's view of a slot (``slots``), the ``.coli_kv`` file format
(``format``), where and how slot state is persisted (``store``), and what
``coli kv inspect`` reports (``inspect``)."""
