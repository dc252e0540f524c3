"""A settings module of the project's own, which the tests of
test_reached_code.py read from a decorated method and change between
calls."""
scale = 1.0


def get():
    return scale


from numpy.random import uniform  # NOQA  (a draw bound before the patches)
