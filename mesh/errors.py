"""The base of every error a user can cause (a setting, a flag, a file), kept in the lowest package so every
package can derive from it; `train.cli.run` turns one into a single `error:` line and exit status 2."""


class UserError(ValueError):
    """A mistake the user can fix; the message is one line that names the setting and the fix.

    A ValueError, so code that catches bad values keeps catching it."""
