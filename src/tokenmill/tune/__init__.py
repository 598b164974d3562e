"""``tokenmill tune``: pick a serving configuration on the user's own traffic, with evidence.

``trace`` reads and writes workloads, ``candidates`` builds the configurations to try,
``search`` decides (pure: no torch, no HTTP), ``runner`` measures one candidate on a real
server, ``report`` writes the HTML report and its charts.
"""
