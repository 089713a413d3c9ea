"""The admin listener's web page: plain HTML, CSS and JavaScript, served by gateway.admin."""
