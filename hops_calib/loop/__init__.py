"""The loop: the protocol that changes the model (candidate files, the gate, evaluate and compare, the audited
held-out report and its looks, plans, the append-only ledger, model files, the calibration record that says which
runs a judgement must be made on, and the scores they all read)."""
