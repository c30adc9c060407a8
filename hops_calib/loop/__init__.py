"""The loop: the protocol that changes the model (candidate files, the gate, evaluate and compare, the audited
held-out report and its looks, plans, the append-only ledger, model files, and the scores they all read)."""
