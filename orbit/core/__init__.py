"""The pure rules of Orbit: states, guards, transitions, retry and cap decisions.

Nothing in this package performs I/O, reads a clock or draws a random number on its
own: time (microseconds since the Unix epoch) and randomness are passed in, and every
decision is returned as a value that a store carries out in one transaction.
"""
