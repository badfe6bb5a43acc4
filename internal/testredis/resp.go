package testredis

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// This file holds a deliberately tiny RESP2 client: commands go out as
// arrays of bulk strings, replies come back as simple strings (+), errors
// (-), integers (:), bulk strings ($) and arrays (*). It is only used for
// test assertions and readiness checks, so it favours simplicity and strict
// limits over speed.

// defaultDoTimeout bounds a Do call (dial, write and read) when the caller
// gives no deadline of its own.
const defaultDoTimeout = 5 * time.Second

// Limits that keep a confused or hostile peer from making the decoder
// allocate without bound.
const (
	maxBulkLen   = 64 << 20 // bytes in one bulk string
	maxArrayLen  = 1 << 20  // elements in one array
	maxNesting   = 16       // nested arrays
	maxLineBytes = 64 << 10 // bytes in one +, -, : or header line
)

// redisError is an error reply (-ERR ...) sent by the server. Its message is
// the reply text, verbatim.
type redisError string

func (e redisError) Error() string { return string(e) }

// reply is one decoded RESP2 value.
type reply struct {
	kind  byte // '+', '-', ':', '$' or '*'
	str   string
	num   int64
	elems []reply
	null  bool // null bulk string ($-1) or null array (*-1)
}

// text renders a reply for Do: simple strings, bulk strings and integers as
// their text, nil as "", arrays as their rendered elements joined by "\n".
func (r reply) text() string {
	switch r.kind {
	case ':':
		return strconv.FormatInt(r.num, 10)
	case '*':
		parts := make([]string, len(r.elems))
		for i, e := range r.elems {
			parts[i] = e.text()
		}
		return strings.Join(parts, "\n")
	default:
		return r.str
	}
}

// writeCommand encodes args as a RESP2 array of bulk strings.
func writeCommand(w *bufio.Writer, args []string) error {
	if len(args) == 0 {
		return errors.New("testredis: empty command")
	}
	fmt.Fprintf(w, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(w, "$%d\r\n", len(a))
		w.WriteString(a)
		w.WriteString("\r\n")
	}
	return w.Flush()
}

// readLine reads one CRLF-terminated line and returns it without the CRLF.
func readLine(r *bufio.Reader) (string, error) {
	var b []byte
	for {
		chunk, err := r.ReadSlice('\n')
		b = append(b, chunk...)
		if err == nil {
			break
		}
		if errors.Is(err, bufio.ErrBufferFull) && len(b) <= maxLineBytes {
			continue
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			return "", errors.New("testredis: protocol error: line too long")
		}
		if errors.Is(err, io.EOF) {
			return "", io.ErrUnexpectedEOF
		}
		return "", err
	}
	if len(b) < 2 || b[len(b)-2] != '\r' {
		return "", fmt.Errorf("testredis: protocol error: line not terminated by CRLF: %q", b)
	}
	return string(b[:len(b)-2]), nil
}

// readReply decodes one RESP2 value.
func readReply(r *bufio.Reader) (reply, error) {
	return readReplyDepth(r, 0)
}

func readReplyDepth(r *bufio.Reader, depth int) (reply, error) {
	if depth > maxNesting {
		return reply{}, errors.New("testredis: protocol error: arrays nested too deeply")
	}
	line, err := readLine(r)
	if err != nil {
		return reply{}, err
	}
	if line == "" {
		return reply{}, errors.New("testredis: protocol error: empty line")
	}
	kind, rest := line[0], line[1:]
	switch kind {
	case '+', '-':
		return reply{kind: kind, str: rest}, nil
	case ':':
		n, err := strconv.ParseInt(rest, 10, 64)
		if err != nil {
			return reply{}, fmt.Errorf("testredis: protocol error: bad integer %q", rest)
		}
		return reply{kind: kind, num: n}, nil
	case '$':
		n, err := strconv.ParseInt(rest, 10, 64)
		if err != nil || n < -1 || n > maxBulkLen {
			return reply{}, fmt.Errorf("testredis: protocol error: bad bulk length %q", rest)
		}
		if n == -1 {
			return reply{kind: kind, null: true}, nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return reply{}, err
		}
		if buf[n] != '\r' || buf[n+1] != '\n' {
			return reply{}, errors.New("testredis: protocol error: bulk string not terminated by CRLF")
		}
		return reply{kind: kind, str: string(buf[:n])}, nil
	case '*':
		n, err := strconv.ParseInt(rest, 10, 64)
		if err != nil || n < -1 || n > maxArrayLen {
			return reply{}, fmt.Errorf("testredis: protocol error: bad array length %q", rest)
		}
		if n == -1 {
			return reply{kind: kind, null: true}, nil
		}
		elems := make([]reply, 0, n)
		for i := int64(0); i < n; i++ {
			e, err := readReplyDepth(r, depth+1)
			if err != nil {
				return reply{}, err
			}
			elems = append(elems, e)
		}
		return reply{kind: kind, elems: elems}, nil
	default:
		return reply{}, fmt.Errorf("testredis: protocol error: unexpected reply type %q", kind)
	}
}

// roundTrip dials addr, sends one command and reads one reply, all bounded
// by ctx's deadline (or defaultDoTimeout if ctx has none) and cancelled
// when ctx is. An error reply from the server is returned as the reply (kind
// '-'), not as an error; the caller decides.
func roundTrip(ctx context.Context, addr string, args []string) (reply, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultDoTimeout)
		defer cancel()
	}
	deadline, _ := ctx.Deadline()

	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return reply{}, err
	}
	defer conn.Close()
	if err := conn.SetDeadline(deadline); err != nil {
		return reply{}, err
	}
	// Cancellation before the deadline: unblock the I/O at once. If the
	// callback has started, wait for it, so no goroutine outlives the call.
	unblocked := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		conn.SetDeadline(time.Unix(1, 0))
		close(unblocked)
	})
	defer func() {
		if !stop() {
			<-unblocked
		}
	}()

	if err := writeCommand(bufio.NewWriter(conn), args); err != nil {
		return reply{}, ctxErr(ctx, deadline, err)
	}
	rep, err := readReply(bufio.NewReader(conn))
	if err != nil {
		return reply{}, ctxErr(ctx, deadline, err)
	}
	return rep, nil
}

// ctxErr reports an I/O failure caused by the context ending as the
// context's error (wrapping the I/O error), so that a caller can test for
// context.DeadlineExceeded whether the context's timer or the connection's
// deadline fired first.
func ctxErr(ctx context.Context, deadline time.Time, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w: %w", cerr, err)
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() && !time.Now().Before(deadline) {
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	}
	return err
}
