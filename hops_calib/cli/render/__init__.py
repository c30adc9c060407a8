"""The command layer's text for people: each module turns one verb group's results (the dataclasses and dicts the
rooms return) into the lines the verb prints. Only the command layer imports it."""
