"""Streaming an epoch: the dealer that keeps reads in flight and hands out chunks in
completion order, the budgets that bound reads and buffered bytes, shared epochs, the
online tuner of the read limits, and returning freed memory after streams end.
"""
