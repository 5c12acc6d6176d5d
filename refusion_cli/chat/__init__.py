"""The terminal chat behind ``refusion chat``.

session.py     one conversation: system message, history, decoder config (validated), the decode call, stats
transcript.py  saving a conversation as JSON, atomically, never over a file unless asked
view.py        the live view: slots filling out of order, coloured by the iteration that committed them
app.py         lines in (questions, slash commands), answers and notices out; Ctrl-C handling

``refusion_cli.cli.chat`` loads the model and picks the mode (interactive, piped, ``--prompt``).
"""

from refusion_cli.chat.app import COMMANDS, AnswerInterrupted, ChatApp, stats_line
from refusion_cli.chat.session import ChatAnswer, ChatSession
from refusion_cli.chat.transcript import FileExists, save_transcript
from refusion_cli.chat.view import LiveAnswer, SlotCanvas

__all__ = ["COMMANDS", "AnswerInterrupted", "ChatAnswer", "ChatApp", "ChatSession", "FileExists", "LiveAnswer",
           "SlotCanvas", "save_transcript", "stats_line"]
