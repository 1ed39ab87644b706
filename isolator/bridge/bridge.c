/*
 * bridge.c: the compiled bridge executable, a drop-in for isolator/bridge/command.py.
 *
 * A Mesos agent with criteo/mesos-command-modules runs one hook command at a time for the whole
 * agent, so every millisecond of this process's life is paid by every container on the node. This
 * program does what the Python bridge does (same arguments, settings, exit statuses, ERR lines,
 * watch and cleanup rules, signal handling; tests/system/test_bridge.py holds both to the same tests)
 * without an interpreter's start: read IN, send it to the sidecar's bridge socket, write the
 * answer to OUT, or one line to ERR and a non-zero exit. It never writes stdout (the agent's log)
 * except for --version and --help.
 *
 *   gpu-isolator-<method> IN OUT ERR        (a symlink named after the method)
 *   gpu-isolator-bridge METHOD IN OUT ERR
 *
 * Wire protocol (isolator/transport/bridge.py): request
 * "gpu-isolator-bridge/2 <method> <ms left> <deadline: CLOCK_MONOTONIC ms>\n" followed by IN's
 * bytes, then the write side is shut; the reply's first line is "OK" (the rest is OUT), "ERROR
 * <CODE> <message>" (final) or "RETRY <pause_ms> <CODE> <message>" (the sidecar shed the call
 * without running it: try again after the pause, doubling up to 500 ms, until the
 * deadline; then the call fails with "<CODE>: <message>").
 *
 * Settings: GPU_ISOLATOR_BRIDGE_SOCKET and GPU_ISOLATOR_BRIDGE_TIMEOUT win over the values in
 * "gpu-isolator-bridge.conf" beside the executable (found through /proc/self/exe; written by
 * `python -m isolator.bridge install DIR --compiled`), which win over the defaults. The file has
 * lines "socket=<path>" and "timeout=<seconds>"; '#' starts a comment line. A file that is present
 * but unreadable or malformed fails the call (exit 2): a bridge never guesses its sidecar.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifndef BRIDGE_VERSION
#error "build with -DBRIDGE_VERSION='\"x.y.z\"' (the Makefile takes it from isolator/__init__.py)"
#endif

/* The framing's names: proto/gpuisolator/v1/wire.proto's BridgeToken, spelled here (this program links
 * no generated code; tests/unit/transport/test_wire_names.py keeps them equal). */
#define PROTOCOL "gpu-isolator-bridge/2"
#define REPLY_OK "OK"
#define REPLY_ERROR "ERROR"
#define REPLY_RETRY "RETRY"
#define DEFAULT_SOCKET "/run/gpu-isolator/isolator.sock.bridge"
#define DEFAULT_TIMEOUT 25.0
#define SOCKET_ENV "GPU_ISOLATOR_BRIDGE_SOCKET"
#define TIMEOUT_ENV "GPU_ISOLATOR_BRIDGE_TIMEOUT"
#define LAUNCHER "gpu-isolator-bridge"
#define CONF_NAME "gpu-isolator-bridge.conf"
#define MAX_PAUSE_MS 500L

enum {
	EXIT_OK = 0,
	EXIT_REFUSED = 1,     /* the sidecar answered with an error; its code and message are in ERR */
	EXIT_USAGE = 2,       /* wrong arguments, an unreadable IN, an unwritable OUT, a bad setting */
	EXIT_UNREACHABLE = 3, /* no sidecar on the socket, or it broke the connection */
	EXIT_DEADLINE = 4,    /* no answer before the deadline */
	EXIT_SIGNAL = 5,      /* SIGTERM (the module's timeout) or SIGINT */
	EXIT_INTERNAL = 6,    /* a bug in the bridge itself (here: out of memory) */
};

static const char *const METHODS[] = {"prepare", "isolate", "watch", "usage", "cleanup"};
#define N_METHODS (sizeof(METHODS) / sizeof(METHODS[0]))

static const char HELP[] =
	"usage: gpu-isolator-<method> IN OUT ERR\n"
	"       gpu-isolator-bridge METHOD IN OUT ERR      (METHOD: prepare, isolate, watch, usage, cleanup)\n"
	"\n"
	"Forwards one isolator call of a Mesos agent (criteo/mesos-command-modules) to the gpu-isolator\n"
	"sidecar's bridge socket: reads the request from IN, writes the answer to OUT, or one line to ERR\n"
	"and a non-zero exit status (1 refused, 2 usage, 3 unreachable, 4 deadline, 5 signal, 6 bug).\n"
	"\n"
	"Install it for an agent with\n"
	"    python -m isolator.bridge install /usr/libexec/gpu-isolator [--socket PATH] [--timeout S] [--compiled]\n"
	"which writes this launcher and one gpu-isolator-<method> link per method; name those paths in the\n"
	"agent's modules.json (docs/mesos-agent.md, \"The two routes in brief\" and section 3).\n"
	"\n"
	"Environment: GPU_ISOLATOR_BRIDGE_SOCKET (default /run/gpu-isolator/isolator.sock.bridge),\n"
	"GPU_ISOLATOR_BRIDGE_TIMEOUT (seconds, default 25).\n";

/* ---- small helpers ------------------------------------------------------------------------- */

struct buf {
	char *data;
	size_t len;
	size_t cap;
};

/* Set by the SIGTERM/SIGINT handler. Both signals stay blocked except inside ppoll, so a signal
 * can only arrive while the bridge waits, and is never lost between a check and a wait. */
static volatile sig_atomic_t caught_signal;
static sigset_t wait_mask;

static void on_signal(int signum)
{
	if (!caught_signal)
		caught_signal = signum;
}

static void out_of_memory(void) __attribute__((noreturn));

static void *xrealloc(void *p, size_t n)
{
	void *q = realloc(p, n ? n : 1);
	if (!q)
		out_of_memory();
	return q;
}

static void buf_add(struct buf *b, const void *data, size_t n)
{
	if (b->len + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 256;
		while (b->len + n + 1 > cap)
			cap *= 2;
		b->data = xrealloc(b->data, cap);
		b->cap = cap;
	}
	if (n)
		memcpy(b->data + b->len, data, n);
	b->len += n;
	b->data[b->len] = '\0';
}

static void buf_str(struct buf *b, const char *s)
{
	buf_add(b, s, strlen(s));
}

static void buf_printf(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void buf_printf(struct buf *b, const char *fmt, ...)
{
	char small[128];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(small, sizeof small, fmt, ap);
	va_end(ap);
	if (n < 0)
		out_of_memory();
	if ((size_t)n < sizeof small) {
		buf_add(b, small, (size_t)n);
		return;
	}
	char *big = xrealloc(NULL, (size_t)n + 1);
	va_start(ap, fmt);
	vsnprintf(big, (size_t)n + 1, fmt, ap);
	va_end(ap);
	buf_add(b, big, (size_t)n);
	free(big);
}

static double monotonic(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Length of the well-formed UTF-8 sequence at s[0..n), or minus the length of the maximal
 * ill-formed subpart there (Unicode's "maximal subpart" rule, which Python's decoder follows). */
static long utf8_step(const unsigned char *s, size_t n, unsigned *cp)
{
	unsigned c = s[0];
	size_t need;
	unsigned lo = 0x80, hi = 0xBF, v;
	if (c < 0x80) {
		*cp = c;
		return 1;
	} else if (c >= 0xC2 && c <= 0xDF) {
		need = 1;
		v = c & 0x1F;
	} else if (c >= 0xE0 && c <= 0xEF) {
		need = 2;
		v = c & 0x0F;
		if (c == 0xE0)
			lo = 0xA0;
		if (c == 0xED)
			hi = 0x9F;
	} else if (c >= 0xF0 && c <= 0xF4) {
		need = 3;
		v = c & 0x07;
		if (c == 0xF0)
			lo = 0x90;
		if (c == 0xF4)
			hi = 0x8F;
	} else {
		return -1;
	}
	size_t i;
	for (i = 1; i <= need; i++) {
		if (i >= n || s[i] < lo || s[i] > hi)
			return -(long)i;
		v = (v << 6) | (s[i] & 0x3F);
		lo = 0x80;
		hi = 0xBF;
	}
	*cp = v;
	return (long)i;
}

/* Text as Python holds it, back as UTF-8 bytes: an ill-formed subpart becomes `bad` once
 * (decode "replace": U+FFFD) or once per byte (surrogateescape then encode "replace": '?'). */
enum { BAD_ONCE, BAD_PER_BYTE };

static void add_text(struct buf *b, const char *s, size_t n, int mode)
{
	const unsigned char *u = (const unsigned char *)s;
	size_t i = 0;
	while (i < n) {
		unsigned cp;
		long step = utf8_step(u + i, n - i, &cp);
		if (step > 0) {
			buf_add(b, u + i, (size_t)step);
			i += (size_t)step;
		} else if (mode == BAD_ONCE) {
			buf_str(b, "\xEF\xBF\xBD");
			i += (size_t)-step;
		} else {
			for (long k = 0; k < -step; k++)
				buf_str(b, "?");
			i += (size_t)-step;
		}
	}
}

static void add_path(struct buf *b, const char *s)
{
	add_text(b, s, strlen(s), BAD_PER_BYTE);
}

static int is_py_space(unsigned cp)
{
	return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
	       cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
	       cp == 0x205F || cp == 0x3000;
}

/* " ".join(line.split()) of well-formed UTF-8: the ERR line is one line, its words single-spaced. */
static void one_line(const struct buf *in, struct buf *out)
{
	const unsigned char *u = (const unsigned char *)in->data;
	size_t i = 0;
	int pending_space = 0;
	while (i < in->len) {
		unsigned cp;
		long step = utf8_step(u + i, in->len - i, &cp);
		size_t n = step > 0 ? (size_t)step : (size_t)-step;
		if (step > 0 && is_py_space(cp)) {
			pending_space = out->len > 0;
		} else {
			if (pending_space)
				buf_str(out, " ");
			pending_space = 0;
			buf_add(out, u + i, n);
		}
		i += n;
	}
}

/* Python's repr() of bytes. */
static void add_bytes_repr(struct buf *b, const unsigned char *s, size_t n)
{
	char quote = '\'';
	if (memchr(s, '\'', n) && !memchr(s, '"', n))
		quote = '"';
	buf_printf(b, "b%c", quote);
	for (size_t i = 0; i < n; i++) {
		unsigned char c = s[i];
		if (c == (unsigned char)quote || c == '\\')
			buf_printf(b, "\\%c", c);
		else if (c == '\t')
			buf_str(b, "\\t");
		else if (c == '\n')
			buf_str(b, "\\n");
		else if (c == '\r')
			buf_str(b, "\\r");
		else if (c < 0x20 || c >= 0x7F)
			buf_printf(b, "\\x%02x", c);
		else
			buf_add(b, &c, 1);
	}
	buf_printf(b, "%c", quote);
}

static int is_py_printable(unsigned cp)
{
	/* Close enough to str.isprintable() for what reaches a message: controls and the C1 block,
	 * spaces other than ' ', separators and U+FFFD's neighbours are escaped or kept as Python does
	 * for the characters a setting can realistically hold. */
	if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD)
		return 0;
	if (cp != 0x20 && is_py_space(cp))
		return 0;
	return 1;
}

/* Python's repr() of a str given as well-formed UTF-8. */
static void add_str_repr(struct buf *b, const char *s, size_t n)
{
	char quote = '\'';
	if (memchr(s, '\'', n) && !memchr(s, '"', n))
		quote = '"';
	buf_printf(b, "%c", quote);
	const unsigned char *u = (const unsigned char *)s;
	size_t i = 0;
	while (i < n) {
		unsigned cp;
		long step = utf8_step(u + i, n - i, &cp);
		size_t len = step > 0 ? (size_t)step : (size_t)-step;
		if (step < 0)
			cp = 0xFFFD;
		if (cp == (unsigned char)quote || cp == '\\')
			buf_printf(b, "\\%c", (char)cp);
		else if (cp == '\t')
			buf_str(b, "\\t");
		else if (cp == '\n')
			buf_str(b, "\\n");
		else if (cp == '\r')
			buf_str(b, "\\r");
		else if (is_py_printable(cp))
			buf_add(b, u + i, len);
		else if (cp < 0x100)
			buf_printf(b, "\\x%02x", cp);
		else
			buf_printf(b, "\\u%04x", cp);
		i += len;
	}
	buf_printf(b, "%c", quote);
}

/* Python's repr() of a float: the shortest digits that read back the same, fixed notation with
 * ".0" when the decimal exponent is in [-4, 16), else "de+XX". */
static void add_float_repr(struct buf *b, double x)
{
	if (x != x) {
		buf_str(b, "nan");
		return;
	}
	if (x > 1.7976931348623157e308 || x < -1.7976931348623157e308) {
		buf_str(b, x > 0 ? "inf" : "-inf");
		return;
	}
	char tmp[64];
	int prec;
	for (prec = 0; prec < 17; prec++) {
		snprintf(tmp, sizeof tmp, "%.*e", prec, x);
		if (strtod(tmp, NULL) == x)
			break;
	}
	/* tmp: [-]d[.ddd]e[+-]XX */
	char digits[32];
	size_t nd = 0;
	const char *p = tmp;
	int negative = *p == '-';
	if (negative)
		p++;
	for (; *p && *p != 'e'; p++)
		if (*p >= '0' && *p <= '9')
			digits[nd++] = *p;
	int exp10 = atoi(p + 1);
	while (nd > 1 && digits[nd - 1] == '0')
		nd--;
	digits[nd] = '\0';
	int decpt = exp10 + 1; /* value = 0.d1d2... x 10^decpt */
	if (negative)
		buf_str(b, "-");
	if (decpt > -4 && decpt <= 16) {
		if (decpt <= 0) {
			buf_str(b, "0.");
			for (int i = 0; i < -decpt; i++)
				buf_str(b, "0");
			buf_str(b, digits);
		} else if ((size_t)decpt >= nd) {
			buf_str(b, digits);
			for (size_t i = nd; i < (size_t)decpt; i++)
				buf_str(b, "0");
			buf_str(b, ".0");
		} else {
			buf_add(b, digits, (size_t)decpt);
			buf_str(b, ".");
			buf_str(b, digits + decpt);
		}
	} else {
		buf_add(b, digits, 1);
		if (nd > 1) {
			buf_str(b, ".");
			buf_str(b, digits + 1);
		}
		buf_printf(b, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
	}
}

/* float(text) as Python reads a number of seconds (ASCII forms): surrounding whitespace, a sign,
 * digits with single underscores between them, a fraction, an exponent, inf/infinity/nan. */
static int parse_py_float(const char *text, double *value)
{
	size_t n = strlen(text);
	while (n && is_py_space((unsigned char)text[n - 1]))
		n--;
	while (n && is_py_space((unsigned char)*text)) {
		text++;
		n--;
	}
	char clean[128];
	size_t k = 0, i = 0;
	if (n == 0 || n >= sizeof clean)
		return -1;
	if (text[i] == '+' || text[i] == '-')
		clean[k++] = text[i++];
	const char *word = text + i;
	size_t wn = n - i;
	static const char *const words[] = {"inf", "infinity", "nan"};
	for (size_t w = 0; w < 3; w++) {
		if (wn == strlen(words[w]) && strncasecmp(word, words[w], wn) == 0) {
			memcpy(clean + k, word, wn);
			clean[k + wn] = '\0';
			*value = strtod(clean, NULL);
			return 0;
		}
	}
	int digits = 0, part_digits = 0, seen_dot = 0, seen_exp = 0;
	char prev = 0;
	for (; i < n; i++) {
		char c = text[i];
		if (c >= '0' && c <= '9') {
			clean[k++] = c;
			digits++;
			part_digits++;
		} else if (c == '_') {
			if (!(prev >= '0' && prev <= '9') || i + 1 >= n || !(text[i + 1] >= '0' && text[i + 1] <= '9'))
				return -1;
		} else if (c == '.' && !seen_dot && !seen_exp) {
			seen_dot = 1;
			clean[k++] = c;
		} else if ((c == 'e' || c == 'E') && !seen_exp && digits) {
			seen_exp = 1;
			part_digits = 0;
			clean[k++] = c;
			if (i + 1 < n && (text[i + 1] == '+' || text[i + 1] == '-'))
				clean[k++] = text[++i];
			c = 'e';
		} else {
			return -1;
		}
		prev = c;
	}
	if (!digits || (seen_exp && !part_digits))
		return -1;
	clean[k] = '\0';
	*value = strtod(clean, NULL);
	return 0;
}

/* ---- failures ------------------------------------------------------------------------------ */

struct failure {
	int status;
	struct buf message; /* well-formed UTF-8 */
	int harmless_for_cleanup;
};

static struct failure *fail(struct failure *f, int status, int harmless)
{
	f->status = status;
	f->harmless_for_cleanup = harmless;
	f->message.len = 0;
	buf_add(&f->message, "", 0);
	return f;
}

static const char *method_name = "bridge";
static const char *err_path;

static void write_all(int fd, const char *data, size_t n)
{
	while (n) {
		ssize_t w = write(fd, data, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return;
		data += w;
		n -= (size_t)w;
	}
}

/* One line on stderr (the agent's log). */
static void log_line(const struct buf *line)
{
	struct buf out = {0};
	one_line(line, &out);
	buf_str(&out, "\n");
	write_all(2, out.data, out.len);
	free(out.data);
}

/* One line without a newline in ERR (the module appends it to its Failure verbatim), or on
 * stderr when ERR is unknown or cannot be written. */
static void report(const struct buf *line)
{
	struct buf out = {0};
	one_line(line, &out);
	if (err_path) {
		int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
		if (fd >= 0) {
			ssize_t w = out.len ? write(fd, out.data, out.len) : 0;
			int closed = close(fd);
			if (w == (ssize_t)out.len && closed == 0) {
				free(out.data);
				return;
			}
		}
	}
	buf_str(&out, "\n");
	write_all(2, out.data, out.len);
	free(out.data);
}

static void out_of_memory(void)
{
	static const char line[] = "internal error in the bridge: out of memory";
	if (strcmp(method_name, "watch") == 0) {
		static const char quiet[] = "gpu-isolator watch: internal error in the bridge: out of memory;"
					    " no limitation reported, the module polls again\n";
		write_all(2, quiet, sizeof quiet - 1);
		_exit(EXIT_OK);
	}
	if (err_path) {
		int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
		if (fd >= 0) {
			write_all(fd, "gpu-isolator ", 13);
			write_all(fd, method_name, strlen(method_name));
			write_all(fd, ": ", 2);
			write_all(fd, line, sizeof line - 1);
			close(fd);
		}
	}
	_exit(EXIT_INTERNAL);
}

/* ---- settings ------------------------------------------------------------------------------ */

struct settings {
	char *socket_path; /* from the conf file, or NULL */
	double timeout;    /* from the conf file, or -1 */
	int has_timeout;
};

/* The conf file beside the executable: absent is fine (the defaults), anything else wrong fails. */
static int read_conf(const char *argv0, struct settings *s, struct failure *f)
{
	char exe[4096];
	ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
	if (n > 0) {
		exe[n] = '\0';
	} else if (argv0 && strchr(argv0, '/') && strlen(argv0) < sizeof exe) {
		strcpy(exe, argv0);
	} else {
		return 0;
	}
	char *slash = strrchr(exe, '/');
	if (!slash)
		return 0;
	struct buf path = {0};
	buf_add(&path, exe, (size_t)(slash - exe) + 1);
	buf_str(&path, CONF_NAME);
	int fd = open(path.data, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT) {
			free(path.data);
			return 0;
		}
		fail(f, EXIT_USAGE, 0);
		buf_str(&f->message, "cannot read the bridge settings '");
		add_path(&f->message, path.data);
		buf_printf(&f->message, "': %s", strerror(errno));
		free(path.data);
		return -1;
	}
	struct buf text = {0};
	char chunk[4096];
	for (;;) {
		ssize_t r = read(fd, chunk, sizeof chunk);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			int e = errno;
			close(fd);
			fail(f, EXIT_USAGE, 0);
			buf_str(&f->message, "cannot read the bridge settings '");
			add_path(&f->message, path.data);
			buf_printf(&f->message, "': %s", strerror(e));
			free(path.data);
			free(text.data);
			return -1;
		}
		if (r == 0)
			break;
		buf_add(&text, chunk, (size_t)r);
	}
	close(fd);
	buf_add(&text, "", 0);
	int lineno = 0;
	char *line = text.data, *next;
	for (; line && *line; line = next) {
		lineno++;
		next = strchr(line, '\n');
		if (next)
			*next++ = '\0';
		if (*line == '\0' || *line == '#')
			continue;
		const char *bad = NULL;
		if (strncmp(line, "socket=", 7) == 0 && line[7]) {
			free(s->socket_path);
			s->socket_path = strdup(line + 7);
			if (!s->socket_path)
				out_of_memory();
		} else if (strncmp(line, "timeout=", 8) == 0) {
			char *end;
			errno = 0;
			s->timeout = strtod(line + 8, &end);
			s->has_timeout = 1;
			if (end == line + 8 || *end || errno)
				bad = "timeout is not a number of seconds";
		} else {
			bad = "expected 'socket=<path>' or 'timeout=<seconds>'";
		}
		if (bad) {
			fail(f, EXIT_USAGE, 0);
			buf_str(&f->message, "bad bridge settings in '");
			add_path(&f->message, path.data);
			buf_printf(&f->message, "' line %d: %s", lineno, bad);
			free(path.data);
			free(text.data);
			return -1;
		}
	}
	free(path.data);
	free(text.data);
	return 0;
}

static int settings(const char *argv0, const char **socket_path, double *timeout, struct failure *f)
{
	struct settings conf = {NULL, -1, 0};
	if (read_conf(argv0, &conf, f) < 0)
		return -1;
	const char *env = getenv(SOCKET_ENV);
	*socket_path = env && *env ? env : conf.socket_path ? conf.socket_path : DEFAULT_SOCKET;
	*timeout = conf.has_timeout ? conf.timeout : DEFAULT_TIMEOUT;
	const char *raw = getenv(TIMEOUT_ENV);
	if (raw && *raw) {
		if (parse_py_float(raw, timeout) < 0) {
			fail(f, EXIT_USAGE, 0);
			buf_str(&f->message, TIMEOUT_ENV "=");
			struct buf text = {0};
			add_text(&text, raw, strlen(raw), BAD_ONCE);
			add_str_repr(&f->message, text.data, text.len);
			free(text.data);
			buf_str(&f->message, " is not a number of seconds");
			return -1;
		}
	}
	if (!(*timeout > 0 && *timeout < 86400)) {
		fail(f, EXIT_USAGE, 0);
		buf_str(&f->message, "bridge timeout ");
		add_float_repr(&f->message, *timeout);
		buf_str(&f->message, " s must be above 0 and below a day");
		return -1;
	}
	return 0;
}

/* ---- files --------------------------------------------------------------------------------- */

static int read_file(const char *path, struct buf *data, struct failure *f)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	int e = 0;
	if (fd < 0) {
		e = errno;
	} else {
		char chunk[65536];
		for (;;) {
			ssize_t r = read(fd, chunk, sizeof chunk);
			if (r < 0 && errno == EINTR)
				continue;
			if (r < 0) {
				e = errno;
				break;
			}
			if (r == 0)
				break;
			buf_add(data, chunk, (size_t)r);
		}
		close(fd);
	}
	if (!e) {
		buf_add(data, "", 0);
		return 0;
	}
	fail(f, EXIT_USAGE, 0);
	buf_str(&f->message, "failed to read input file '");
	add_path(&f->message, path);
	buf_printf(&f->message, "': %s", strerror(e));
	return -1;
}

static int write_file(const char *path, const char *data, size_t n, struct failure *f)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
	int e = 0;
	if (fd < 0) {
		e = errno;
	} else {
		while (n) {
			ssize_t w = write(fd, data, n);
			if (w < 0 && errno == EINTR)
				continue;
			if (w < 0) {
				e = errno;
				break;
			}
			data += w;
			n -= (size_t)w;
		}
		if (close(fd) < 0 && !e)
			e = errno;
	}
	if (!e)
		return 0;
	fail(f, EXIT_USAGE, 0);
	buf_str(&f->message, "failed to write output file '");
	add_path(&f->message, path);
	buf_printf(&f->message, "': %s", strerror(e));
	return -1;
}

/* ---- the call ------------------------------------------------------------------------------ */

enum { CALL_DONE = 0, CALL_FAILED = -1, CALL_SIGNALLED = -2 };

/* Wait for `events` on fd (or just the time, fd < 0) until `deadline`: 1 ready, 0 deadline,
 * CALL_SIGNALLED on SIGTERM/SIGINT. */
static int wait_until(int fd, short events, double deadline)
{
	for (;;) {
		if (caught_signal)
			return CALL_SIGNALLED;
		double left = deadline - monotonic();
		if (left <= 0)
			return 0;
		struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
		struct pollfd pfd = {fd, events, 0};
		int r = ppoll(fd >= 0 ? &pfd : NULL, fd >= 0 ? 1 : 0, &ts, &wait_mask);
		if (caught_signal)
			return CALL_SIGNALLED;
		if (r > 0)
			return 1;
		if (r < 0 && errno != EINTR)
			return 1; /* let the following syscall report it */
	}
}

static void late(struct failure *f, const char *path, double total)
{
	fail(f, EXIT_DEADLINE, 0);
	buf_str(&f->message, "no answer from the sidecar at '");
	add_path(&f->message, path);
	buf_printf(&f->message, "' within %g s", total);
}

struct reply {
	struct buf raw;
	const char *kind; /* REPLY_OK, REPLY_ERROR, REPLY_RETRY */
	size_t rest;      /* OK: where OUT's bytes start */
	long pause_ms;    /* RETRY */
	struct buf code;
	struct buf message;
};

static int call_once(const char *path, const char *method, const struct buf *payload, double deadline,
		     double total, struct reply *reply, struct failure *f)
{
	if (deadline - monotonic() <= 0) {
		late(f, path, total);
		return CALL_FAILED;
	}
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		fail(f, EXIT_INTERNAL, 0);
		buf_printf(&f->message, "internal error in the bridge: socket(): %s", strerror(errno));
		return CALL_FAILED;
	}
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	int rc = CALL_DONE;
	if (strlen(path) >= sizeof addr.sun_path) {
		fail(f, EXIT_UNREACHABLE, 0);
		buf_str(&f->message, "cannot reach the sidecar at '");
		add_path(&f->message, path);
		buf_str(&f->message, "': AF_UNIX path too long");
		rc = CALL_FAILED;
		goto out;
	}
	strcpy(addr.sun_path, path);
	if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
		int e = errno;
		int down = e == ENOENT || e == ECONNREFUSED;
		fail(f, EXIT_UNREACHABLE, down);
		buf_str(&f->message, "cannot reach the sidecar at '");
		add_path(&f->message, path);
		buf_printf(&f->message, "': %s%s", strerror(e), down ? " (is 'gpu-isolator serve' running?)" : "");
		rc = CALL_FAILED;
		goto out;
	}
	struct buf request = {0};
	double left = deadline - monotonic();
	/* The timeout left and the deadline itself on CLOCK_MONOTONIC (the clock Python's
	 * time.monotonic() reads): a call the sidecar reads after it (it was stopped meanwhile) is
	 * answered DEADLINE_EXCEEDED without running. */
	buf_printf(&request, PROTOCOL " %s %ld %lld\n", method, (long)(left * 1000), (long long)(deadline * 1000));
	buf_add(&request, payload->data, payload->len);
	size_t sent = 0;
	while (sent < request.len) {
		ssize_t w = send(fd, request.data + sent, request.len - sent, MSG_NOSIGNAL);
		if (w > 0) {
			sent += (size_t)w;
			continue;
		}
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && errno == EAGAIN) {
			int ready = wait_until(fd, POLLOUT, deadline);
			if (ready == 1)
				continue;
			rc = ready;
			if (ready == 0) {
				late(f, path, total);
				rc = CALL_FAILED;
			}
			free(request.data);
			goto out;
		}
		break; /* it may have answered early (a request over its size limit): read the answer */
	}
	free(request.data);
	shutdown(fd, SHUT_WR);
	char chunk[65536];
	for (;;) {
		ssize_t r = recv(fd, chunk, sizeof chunk, 0);
		if (r > 0) {
			buf_add(&reply->raw, chunk, (size_t)r);
			continue;
		}
		if (r == 0)
			break;
		if (errno == EINTR)
			continue;
		if (errno == EAGAIN) {
			int ready = wait_until(fd, POLLIN, deadline);
			if (ready == 1)
				continue;
			rc = ready;
			if (ready == 0) {
				late(f, path, total);
				rc = CALL_FAILED;
			}
			goto out;
		}
		int e = errno;
		fail(f, EXIT_UNREACHABLE, 0);
		buf_str(&f->message, "the sidecar at '");
		add_path(&f->message, path);
		buf_printf(&f->message, "' dropped the call: %s", strerror(e));
		rc = CALL_FAILED;
		goto out;
	}
out:
	close(fd);
	return rc;
}

static int all_digits(const char *s, size_t n)
{
	if (!n)
		return 0;
	for (size_t i = 0; i < n; i++)
		if (s[i] < '0' || s[i] > '9')
			return 0;
	return 1;
}

/* Splits the reply's first line. 0, or -1 with the failure filled for a reply not understood. */
static int parse_reply(struct reply *r, const char *path, struct failure *f)
{
	buf_add(&r->raw, "", 0);
	const char *data = r->raw.data;
	const char *nl = memchr(data, '\n', r->raw.len);
	size_t status_len = nl ? (size_t)(nl - data) : r->raw.len;
	r->rest = nl ? status_len + 1 : r->raw.len;
	const char *body = NULL;
	const size_t ok_len = strlen(REPLY_OK), error_len = strlen(REPLY_ERROR) + 1;
	const size_t retry_len = strlen(REPLY_RETRY) + 1;
	if (status_len == ok_len && memcmp(data, REPLY_OK, ok_len) == 0) {
		r->kind = REPLY_OK;
		return 0;
	}
	if (status_len >= error_len && memcmp(data, REPLY_ERROR " ", error_len) == 0) {
		r->kind = REPLY_ERROR;
		body = data + error_len;
	} else if (status_len >= retry_len && memcmp(data, REPLY_RETRY " ", retry_len) == 0) {
		/* "RETRY <digits> <CODE>[ <message>]"; a pause above MAX_PAUSE_MS counts as that. */
		const char *p = data + retry_len, *end = data + status_len;
		const char *sp1 = memchr(p, ' ', (size_t)(end - p));
		if (sp1 && all_digits(p, (size_t)(sp1 - p)) && sp1 + 1 < end && sp1[1] != ' ') {
			r->kind = REPLY_RETRY;
			r->pause_ms = 0;
			for (const char *d = p; d < sp1 && r->pause_ms <= MAX_PAUSE_MS; d++)
				r->pause_ms = r->pause_ms * 10 + (*d - '0');
			if (r->pause_ms > MAX_PAUSE_MS)
				r->pause_ms = MAX_PAUSE_MS;
			body = sp1 + 1;
		}
	}
	if (body) {
		const char *end = data + status_len;
		const char *sp = memchr(body, ' ', (size_t)(end - body));
		const char *code_end = sp ? sp : end;
		add_text(&r->code, body, (size_t)(code_end - body), BAD_ONCE);
		if (sp)
			add_text(&r->message, sp + 1, (size_t)(end - sp - 1), BAD_ONCE);
		buf_add(&r->code, "", 0);
		buf_add(&r->message, "", 0);
		return 0;
	}
	fail(f, EXIT_UNREACHABLE, 0);
	buf_str(&f->message, "the sidecar at '");
	add_path(&f->message, path);
	if (r->raw.len == 0) {
		buf_str(&f->message, "' closed the connection without an answer");
	} else {
		buf_str(&f->message, "' answered something unintelligible: ");
		add_bytes_repr(&f->message, (const unsigned char *)data, status_len < 60 ? status_len : 60);
	}
	return -1;
}

static void refused(const struct reply *r, struct failure *f)
{
	/* A shed call never ran, so it is never harmless, whatever its code. */
	int harmless = strcmp(r->kind, REPLY_ERROR) == 0 &&
		       (strcmp(r->code.data, "NOT_FOUND") == 0 || strcmp(r->code.data, "INVALID_ARGUMENT") == 0);
	fail(f, EXIT_REFUSED, harmless);
	buf_printf(&f->message, "%s: %s", r->code.data, r->message.data);
}

static void reply_free(struct reply *r)
{
	free(r->raw.data);
	free(r->code.data);
	free(r->message.data);
	memset(r, 0, sizeof *r);
}

/* Sends the request until it is answered OK (OUT's bytes in `out`), refused, or shed past the
 * deadline. */
static int call(const char *path, const char *method, const struct buf *payload, double total, struct buf *out,
		struct failure *f)
{
	double deadline = monotonic() + total;
	long wait_ms = 0;
	for (;;) {
		struct reply r = {0};
		int rc = call_once(path, method, payload, deadline, total, &r, f);
		if (rc == CALL_DONE && parse_reply(&r, path, f) < 0)
			rc = CALL_FAILED;
		if (rc != CALL_DONE) {
			reply_free(&r);
			return rc;
		}
		if (strcmp(r.kind, REPLY_OK) == 0) {
			buf_add(out, r.raw.data + r.rest, r.raw.len - r.rest);
			reply_free(&r);
			return CALL_DONE;
		}
		if (strcmp(r.kind, REPLY_ERROR) == 0) {
			refused(&r, f);
			reply_free(&r);
			return CALL_FAILED;
		}
		/* RETRY: the sidecar shed the call; pause, doubling, at most MAX_PAUSE_MS, and give up
		 * when the pause would leave less than itself before the deadline. */
		long asked = r.pause_ms;
		wait_ms = asked > 2 * wait_ms ? asked : 2 * wait_ms;
		if (wait_ms < 1)
			wait_ms = 1; /* never a busy loop on "RETRY 0" */
		if (wait_ms > MAX_PAUSE_MS)
			wait_ms = MAX_PAUSE_MS;
		if (deadline - monotonic() < 2 * (double)wait_ms / 1000) {
			refused(&r, f);
			reply_free(&r);
			return CALL_FAILED;
		}
		reply_free(&r);
		if (wait_until(-1, 0, monotonic() + (double)wait_ms / 1000) == CALL_SIGNALLED)
			return CALL_SIGNALLED;
	}
}

/* ---- main ---------------------------------------------------------------------------------- */

static const char *basename_of(const char *path)
{
	const char *slash = strrchr(path, '/');
	return slash ? slash + 1 : path;
}

static int is_method(const char *s)
{
	for (size_t i = 0; i < N_METHODS; i++)
		if (strcmp(s, METHODS[i]) == 0)
			return 1;
	return 0;
}

/* A watch poll that could not ask the sidecar: no limitation, one line in the agent's log, exit 0
 * (see command.py's _quiet_watch: a non-zero watch exit makes the module leak its temp files). */
static int quiet_watch(const struct buf *message)
{
	struct buf line = {0};
	buf_str(&line, "gpu-isolator watch: ");
	buf_add(&line, message->data, message->len);
	buf_str(&line, "; no limitation reported, the module polls again");
	log_line(&line);
	free(line.data);
	return EXIT_OK;
}

static int terminated(double started)
{
	struct buf line = {0};
	buf_printf(&line, "gpu-isolator %s: interrupted by %s after %.1f s", method_name,
		   caught_signal == SIGTERM ? "SIGTERM" : "SIGINT", monotonic() - started);
	/* The module never reads ERR after its own timeout's SIGTERM: the agent's log gets it too. */
	report(&line);
	log_line(&line);
	free(line.data);
	return EXIT_SIGNAL;
}

static int deliver_pending_signals(void)
{
	struct timespec zero = {0, 0};
	ppoll(NULL, 0, &zero, &wait_mask);
	return caught_signal != 0;
}

int main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "--version") == 0) {
		/* As every tool: its own name (gpu-isolator-prepare, the symlink it was run as), then the
		 * version; any other name is the launcher's (as command.py). */
		const char *self = argc > 0 ? basename_of(argv[0]) : "";
		const char *tail = strrchr(self, '-');
		if (strncmp(self, "gpu-isolator-", 13) != 0 || !tail || !is_method(tail + 1))
			self = LAUNCHER;
		struct buf line = {0};
		buf_printf(&line, "%s %s\n", self, BRIDGE_VERSION);
		write_all(1, line.data, line.len);
		free(line.data);
		return EXIT_OK;
	}
	if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
		write_all(1, HELP, sizeof HELP - 1);
		return EXIT_OK;
	}
	sigset_t block;
	sigemptyset(&block);
	sigaddset(&block, SIGTERM);
	sigaddset(&block, SIGINT);
	sigprocmask(SIG_BLOCK, &block, &wait_mask);
	sigdelset(&wait_mask, SIGTERM);
	sigdelset(&wait_mask, SIGINT);
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = on_signal;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	double started = monotonic();

	struct failure f = {0};
	const char *in_path = NULL, *out_path = NULL;
	const char *name = argc > 0 ? basename_of(argv[0]) : "";
	const char *dash = strrchr(name, '-');
	const char *from_name = dash ? dash + 1 : name;
	int rc = CALL_FAILED;
	if (argc == 4 && is_method(from_name)) {
		method_name = from_name;
		in_path = argv[1];
		out_path = argv[2];
		err_path = argv[3];
	} else if (argc == 5 && is_method(argv[1])) {
		method_name = argv[1];
		in_path = argv[2];
		out_path = argv[3];
		err_path = argv[4];
	} else {
		fail(&f, EXIT_USAGE, 0);
		buf_str(&f.message, "usage: gpu-isolator-<method> IN OUT ERR, or " LAUNCHER
				    " METHOD IN OUT ERR; METHOD is one of prepare, isolate, watch, usage, cleanup");
		buf_printf(&f.message, " (got %d argument(s) to '", argc - 1);
		add_path(&f.message, name);
		buf_str(&f.message, "')");
	}
	if (in_path) {
		const char *socket_path;
		double timeout;
		struct buf payload = {0}, out = {0};
		if (settings(argc > 0 ? argv[0] : NULL, &socket_path, &timeout, &f) == 0 &&
		    read_file(in_path, &payload, &f) == 0) {
			rc = call(socket_path, method_name, &payload, timeout, &out, &f);
			if (rc == CALL_DONE && deliver_pending_signals())
				rc = CALL_SIGNALLED;
			if (rc == CALL_DONE && write_file(out_path, out.data ? out.data : "", out.len, &f) == 0)
				return EXIT_OK;
			if (rc == CALL_DONE)
				rc = CALL_FAILED;
		}
	}
	if (rc == CALL_SIGNALLED || deliver_pending_signals())
		return terminated(started);
	if (strcmp(method_name, "cleanup") == 0 && f.harmless_for_cleanup) {
		/* Reported on stderr (the agent's log) since the module ignores ERR on success. */
		struct buf line = {0};
		buf_str(&line, "gpu-isolator cleanup: ");
		buf_add(&line, f.message.data, f.message.len);
		buf_str(&line, "; reporting success");
		log_line(&line);
		return EXIT_OK;
	}
	if (strcmp(method_name, "watch") == 0)
		return quiet_watch(&f.message);
	struct buf line = {0};
	buf_printf(&line, "gpu-isolator %s: ", method_name);
	buf_add(&line, f.message.data, f.message.len);
	report(&line);
	return f.status;
}
