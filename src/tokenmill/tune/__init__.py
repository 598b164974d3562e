"""``tokenmill tune``: pick a serving configuration on the user's own traffic, with evidence.

``trace`` reads and writes workloads, ``candidates`` builds the configurations to try,
``search`` runs the search loop (pure: no torch, no HTTP) with its ``settings``, its
``cut``, ``refine`` and ``decision`` steps, ``scoring`` and its record ``state``,
``runner`` measures one candidate on a real server, ``report`` writes the HTML report and
its charts.
"""
