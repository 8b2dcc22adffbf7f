"""Static files of the align console (index.html, console.js), served by trainer.align.console."""
